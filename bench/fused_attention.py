"""The fused attention layer of the CPU path against HF's attention layers, side by side:
``python -m bench.fused_attention --out FILE [--dtype bfloat16] [--repeats 3] [--merge]``.

Runs :mod:`bench.profile_step` (W32 greedy, 2 threads by default) alternately with the attention
layers left as HF's (``unfused``: :func:`batchgen.engine.fusion.fuse_model` without its
``attention`` kind; RMSNorms and gated MLPs still fused, linear layers still packed) and fused
(the default path), ``--repeats`` times each, each run in a fresh process. Records each run's
decode-step median and its split (attention ops, linear layers, ``model_other`` = forward minus
both), and per variant the medians over the runs with their min-max spread, and the ratios.
``--merge`` adds this dtype's entry to an existing FILE. The RoPE + cache C pass of the fused layer is no
attention op: it counts in ``model_other``, so compare ``attention + model_other``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNFUSED = ("import functools, runpy, sys; import batchgen.engine.fusion as f; "
           "f.fuse_model = functools.partial(f.fuse_model, kinds=('rms_norm', 'gated_mlp')); "
           "sys.argv[0] = 'profile_step'; runpy.run_module('bench.profile_step', run_name='__main__')")
KEYS = ("step", "attention", "model_other", "attention+model_other", "linear")


def run_once(variant: str, dtype: str, threads: int) -> dict[str, float]:
    """One profile_step run; its medians in milliseconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        args = ["--threads", str(threads), "--dtype", dtype, "--out", str(out)]
        cmd = ([sys.executable, "-c", UNFUSED, *args] if variant == "unfused"
               else [sys.executable, "-m", "bench.profile_step", *args])
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        result = json.loads(out.read_text())
    timers = result["timers_median_seconds"]
    return {"step": 1e3 * result["step_seconds_median"], "attention": 1e3 * timers["attention"],
            "model_other": 1e3 * timers["model_other"],
            "attention+model_other": 1e3 * (timers["attention"] + timers["model_other"]),
            "linear": 1e3 * timers["linear"], "decode_rows": result["decode_rows_median"],
            "linear_gflops": result["linear_gflops_median"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--merge", action="store_true", help="add to an existing --out file")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"unfused": [], "fused": []}
    for _ in range(args.repeats):
        for variant in runs:
            runs[variant].append(run_once(variant, args.dtype, args.threads))
            r = runs[variant][-1]
            print(f"{args.dtype} {variant:8s} step {r['step']:6.1f} ms, attention {r['attention']:5.1f}, "
                  f"model_other {r['model_other']:5.1f}, linear {r['linear']:5.1f}", flush=True)
    summary = {}
    for variant, rs in runs.items():
        summary[variant] = {k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs),
                                "max": max(r[k] for r in rs)} for k in KEYS}
    saved = {k: summary["unfused"][k]["median"] - summary["fused"][k]["median"] for k in KEYS}
    # pairwise: each fused run against the unfused run just before it (same machine state)
    pairs = [{k: u[k] - f[k] for k in KEYS} for u, f in zip(runs["unfused"], runs["fused"])]
    entry = {
        "workload": "W32 (32 prompts) greedy, max_tokens 64 (bench.profile_step)",
        "threads": args.threads, "repeats": args.repeats, "runs": runs, "medians_ms": summary,
        "saved_ms_median": saved,
        "saved_ms_pairs": {k: {"min": min(p[k] for p in pairs), "max": max(p[k] for p in pairs)} for k in KEYS},
        "step_ratio_unfused_over_fused": summary["unfused"]["step"]["median"] / summary["fused"]["step"]["median"],
        "notes": "milliseconds per decode step (medians over a run's decode steps, then over runs); "
                 "unfused = HF's attention layers (three q/k/v GEMMs, torch RoPE, reshape_and_cache), "
                 "fused = FusedAttention (one q/k/v GEMM, RoPE + cache write in one C pass). The C pass "
                 "counts in model_other, not in attention.",
    }
    result = json.loads(args.out.read_text()) if args.merge and args.out.is_file() else {}
    result[args.dtype] = entry
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.dtype}: attention+model_other saved {saved['attention+model_other']:.1f} ms per decode step "
          f"(median), step {summary['unfused']['step']['median']:.1f} -> {summary['fused']['step']['median']:.1f} ms")


if __name__ == "__main__":
    main()
