"""One-command GPU check of the ``cuda`` attention backend (``bash bench/gpu_check.sh``).

    python bench/gpu_check.py [--deadline-s 450] [--stages correctness,bandwidth] [--out F]

Stages, each in its own subprocess with its own time budget (a crash, a hung kernel or a dead
CUDA context in one stage never stops the others), each recorded in the JSON even when it fails
or runs out of time (a stage writes its partial results as it goes). The kernel stages are in
:mod:`bench.gpu_correctness` and :mod:`bench.gpu_kernel_stages`, the engine ones in :mod:`bench.gpu_end_to_end`, the environment
stage in :mod:`bench.gpu_environment`, and the report (the targets, the table) in
:mod:`bench.gpu_report`:

``environment``  GPU, its peak HBM bandwidth, torch, cupy, NVRTC version and header directory.
``correctness``  ``paged_decode_attention`` against the torch backend (the spec): head sizes 64, 80, 96,
                 128, 256; GQA groups 1, 2, 3, 4, 8; float32, float16, bfloat16; ragged lengths;
                 a 9,217-token context; ``reshape_and_cache`` and ``copy_blocks``; and the index
                 checks (a bad block id raises, and the GPU still works after).
``kernel_tests`` ``tests/kernels/test_kernels.py``'s GPU cases on real cupy.
``bandwidth``    the decode kernel's achieved bandwidth, CUDA events with the host excluded
                 (the calls are queued behind a sleep kernel, so they run back to back), as a
                 fraction of the device's peak: batch 1/16/64/256 × context 512/1K/4K/16K ×
                 head 64/128 × float16/bfloat16; beside torch SDPA's flash backend on the
                 already-gathered (dense) cache.
``flashinfer``   FlashInfer's paged decode on the same points, where it installs.
``end_to_end``   the engine against HF ``generate`` on SmolLM2-135M's config with seeded random
                 weights: greedy, beam 4, n=4 seeded; float16 and bfloat16; blocks 16 and 32
                 (:mod:`bench.gpu_end_to_end`).
``throughput``   generated tokens/s of batchgen, HF ``generate`` and HF ``generate_batch`` on a
                 1B model of Llama-3.2-1B's shape, W32 and W256 (:mod:`bench.gpu_end_to_end`).

Without a CUDA GPU (or cupy), every GPU stage is recorded as skipped with the reason. With
``--dry-run`` (``GPU_CHECK_DRY_RUN=1`` in ``gpu_check.sh``) every stage runs instead, up to its
first CUDA call (:func:`gpu_point`), and is recorded as ``no_gpu`` with the point it reached; the
exit status is then 0 when every stage got there without an error. Otherwise the exit status is
0 only if every stage that ran passed. Results: ``--out`` (default ``$OUT/gpu_check.json``
when ``$OUT`` is set, else ``bench/results/gpu_check.json``), and a compact table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (bench/gpu_check.sh): the repo root holds bench
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import (  # noqa: F401 - the stages and the tests use them from here too
    BENCH_BATCHES,
    BENCH_BLOCK_SIZE,
    BENCH_CONTEXTS,
    BENCH_DTYPES,
    BENCH_HEAD_SIZES,
    BENCH_NUM_HEADS,
    BENCH_NUM_KV_HEADS,
    NoGpu,
    ROOT,
    STAGE_BUDGETS,
    STAGES,
    Stage,
    TARGET_FRACTION,
    TARGET_MIN_BATCH,
    TARGET_MIN_CONTEXT,
    TARGET_VS_FLASHINFER,
    bench_points,
    decode_bytes,
    gpu_point,
    is_target,
    write_json,
)
from bench.gpu_environment import peak_bandwidth, stage_environment  # noqa: F401 - the tests use it from here
from bench.gpu_report import merge_flashinfer, render_table, status_of, summarize_targets  # noqa: F401 - likewise


# --------------------------------------------------------------------------- plan
DRY_RUN_STAGE_S = 90.0  # each stage's budget in a dry run
GPU_STAGES = tuple(s for s in STAGES if s != "environment")
# Seconds a stage's process may run past its budget (start-up, writing) before it is killed.
GRACE_S = 15.0


def plan_stages(selected: list[str], deadline_s: float,
                budgets: dict[str, float] | None = None) -> list[tuple[str, float]]:
    """(stage, budget) in run order, the budgets scaled to fit ``deadline_s`` (with the grace
    each stage may overrun by)."""
    budgets = budgets or STAGE_BUDGETS
    unknown = [s for s in selected if s not in budgets]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(budgets)}")
    order = [s for s in budgets if s in selected]
    wanted = sum(budgets[s] for s in order)
    room = deadline_s - GRACE_S * len(order)
    if room <= 0:
        raise ValueError(f"--deadline-s {deadline_s:.0f} leaves no time for {len(order)} stage(s) "
                         f"(each may overrun by {GRACE_S:.0f} s)")
    scale = min(1.0, room / wanted) if wanted else 1.0
    return [(s, budgets[s] * scale) for s in order]


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "bench" / "results" / "gpu_check.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON result (default: $OUT/gpu_check.json "
                   "or bench/results/gpu_check.json)")
    p.add_argument("--deadline-s", type=float, default=450.0, help="wall-clock budget of all stages")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of: " + ", ".join(STAGES))
    p.add_argument("--peak-tbps", type=float, default=None, help="peak memory bandwidth, if the table lacks the GPU")
    p.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each timing (median and spread)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dry-run", action="store_true", help="without a GPU: run every stage up to its first "
                   "CUDA call, then record no_gpu")
    p.add_argument("--setup-log", type=Path, default=None, help="bench/gpu_check.sh's install log, to include")
    # internal: run one stage in this process
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--env-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stage_list = [s.strip() for s in args.stages.split(",") if s.strip()]
    plan_stages(args.stage_list, args.deadline_s)  # validates now, not after the first stage
    if args.out is None:
        args.out = default_out()
    return args


# --------------------------------------------------------------------------- orchestration
def run_stage(name: str, budget_s: float, args: argparse.Namespace, env_json: Path | None) -> dict[str, Any]:
    """Run one stage in a subprocess; its partial JSON survives a timeout or a crash."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        stage_out = Path(tmp) / "stage.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--stage-out", str(stage_out),
               "--budget-s", f"{budget_s:.1f}", "--iters", str(args.iters), "--repeats", str(args.repeats),
               "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
               "--stages", ",".join(args.stage_list), "--deadline-s", str(args.deadline_s)]
        if args.peak_tbps:
            cmd += ["--peak-tbps", str(args.peak_tbps)]
        if args.dry_run:
            cmd += ["--dry-run"]
        if env_json is not None:
            cmd += ["--env-json", str(env_json)]
        start = time.perf_counter()
        error = None
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s + GRACE_S)
            tail = (proc.stdout + proc.stderr)[-3000:]
            if proc.returncode != 0:
                error = f"stage process exited with status {proc.returncode}"
        except subprocess.TimeoutExpired as exc:
            tail = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or ""))[-3000:]
            error = f"killed after {budget_s + GRACE_S:.0f} s (budget {budget_s:.0f} s)"
        data: dict[str, Any] = {}
        if stage_out.exists():
            try:
                data = json.loads(stage_out.read_text())
            except json.JSONDecodeError:
                data = {}
        if error:
            data.setdefault("passed", False)
            data["error"] = (data.get("error", "") + "\n" + error).strip()
            data["output_tail"] = tail
        elif not data:
            data = {"passed": False, "error": "the stage wrote no result", "output_tail": tail}
        data["wall_s"] = time.perf_counter() - start
        data["budget_s"] = budget_s
        return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        return stage_main(args)
    t0 = time.perf_counter()
    plan = plan_stages(args.stage_list, args.deadline_s)
    if args.dry_run:  # no GPU work: room for slow imports on a small machine
        plan = [(name, max(budget, DRY_RUN_STAGE_S)) for name, budget in plan]
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "plan": {name: round(b, 1) for name, b in plan},
                              "host": {"python": platform.python_version(), "machine": platform.machine()}}
    if args.setup_log and args.setup_log.exists():
        result["setup_log_tail"] = args.setup_log.read_text(errors="replace")[-4000:]
    write_json(args.out, result)
    gpu_reason = None
    saved = 0.0  # budget earlier stages left unused
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        env_json = Path(tmp) / "environment.json"
        for name, budget in plan:
            if name != "environment" and gpu_reason and not args.dry_run:
                result[name] = {"skipped": gpu_reason, "wall_s": 0.0}
            else:
                left = args.deadline_s - (time.perf_counter() - t0)
                planned = budget
                budget = min(budget + saved, left - GRACE_S)
                if budget < 5:
                    result[name] = {"skipped": "no time left before the deadline", "wall_s": 0.0}
                else:
                    result[name] = run_stage(name, budget, args, env_json if env_json.exists() else None)
                    saved = max(0.0, planned + saved - result[name]["wall_s"])
            if name == "environment":
                env = result[name]
                if env.get("passed") or "gpu" in env:
                    write_json(env_json, env)
                gpu_reason = env.get("gpu_unavailable")
                if gpu_reason is None and not env.get("passed"):
                    gpu_reason = "the environment stage failed"
            if name == "flashinfer" or (name == "bandwidth" and "flashinfer" in result):
                merge_flashinfer(result)
            stage = result[name]
            line = f"{name}: {status_of(stage)} ({stage.get('wall_s', 0):.1f} s)"
            print(line + (f": {stage['no_gpu']}" if "no_gpu" in stage else ""), flush=True)
            write_json(args.out, result)
    result["targets"] = summarize_targets(result)
    if args.dry_run:
        result["dry_run"] = True
        # every stage got to its first CUDA call (or finished) without an error
        result["passed"] = all(result[n].get("passed") for n, _ in plan)
        result["wall_s"] = time.perf_counter() - t0
        write_json(args.out, result)
        print(render_table(result))
        print(f"wrote {args.out} (dry run: {'every stage reached its GPU point' if result['passed'] else 'FAILED'})")
        return 0 if result["passed"] else 1
    ran = [result[n] for n, _ in plan if not result[n].get("skipped")]
    result["passed"] = bool(ran) and all(s.get("passed") for s in ran) and not gpu_reason
    result["wall_s"] = time.perf_counter() - t0
    write_json(args.out, result)
    print(render_table(result))
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


# --------------------------------------------------------------------------- stages


def stage_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    stage = Stage(args.stage_out or Path(tempfile.mkdtemp()) / "stage.json", args.budget_s)
    env = json.loads(args.env_json.read_text()) if args.env_json and args.env_json.exists() else {}
    from bench import gpu_correctness as correctness
    from bench import gpu_end_to_end as e2e
    from bench import gpu_kernel_stages as ks

    fn: Callable[..., None] = {"environment": stage_environment, "correctness": correctness.stage_correctness,
                               "kernel_tests": ks.stage_kernel_tests, "bandwidth": ks.stage_bandwidth,
                               "flashinfer": ks.stage_flashinfer, "end_to_end": e2e.stage_end_to_end,
                               "throughput": e2e.stage_throughput}[args.stage]
    try:
        fn(stage, args, env)
    except NoGpu as exc:
        stage.data.update(no_gpu=str(exc), passed=True)
    except Exception:  # noqa: BLE001 - recorded; the orchestrator goes on with the next stage
        stage.data["passed"] = False
        stage.data["error"] = traceback.format_exc()[-4000:]
    stage.save()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(ROOT))
    sys.modules["bench.gpu_check"] = sys.modules[__name__]  # one NoGpu, whoever imports it
    sys.exit(main())
