"""One-command GPU check of the CUDA attention backend; writes bench/results/gpu_check.json.

    python bench/gpu_check.py            # or: bash bench/gpu_check.sh

Three phases, each time-boxed so the whole run stays under 8 minutes, each recorded in the JSON
even when another fails:

1. ``kernel_tests``: tests/kernels/test_kernels.py on real cupy (the ``gpu`` parametrisation).
2. ``end_to_end``: greedy generation with ``LLM(..., attention_backend="cuda")`` against
   ``attention_backend="torch"`` on the default model, float32, comparing token ids.
3. ``bandwidth``: ``paged_decode_attention`` against torch SDPA over gathered K/V, batch 1-256,
   context 128-8K, reporting time, achieved HBM bandwidth (K/V bytes + query + output over
   the kernel time) and its fraction of the H200's ~4.8 TB/s.

Exit status 0 only if every phase passed. Needs a CUDA GPU, torch with CUDA, and cupy
(``pip install 'batchgen[cuda]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

H200_HBM_BYTES_PER_S = 4.8e12
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (128, 512, 2048, 8192)
# A Llama-3-8B-shaped layer: 32 query heads over 8 KV heads of 128, float16, 16-token blocks.
BENCH_SHAPE = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16}


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["torch_cuda"] = torch.version.cuda
    try:
        import cupy

        env["cupy"] = cupy.__version__
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        env["cupy_error"] = f"{type(exc).__name__}: {exc}"
    from batchgen.kernels.cuda.attention import nvrtc_include_dirs

    env["nvrtc_include_dirs"] = nvrtc_include_dirs()
    return env


def kernel_tests(timeout: float) -> dict[str, Any]:
    """Runs the kernel tests' GPU cases in a subprocess; parses the JUnit report."""
    report = ROOT / "bench" / "results" / "gpu_kernel_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu",
           f"--junitxml={report}", "tests/kernels/test_kernels.py"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"timed out after {timeout:.0f} s"}
    result: dict[str, Any] = {"returncode": proc.returncode, "seconds": time.perf_counter() - start,
                              "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    if report.exists():
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        result.update(counts)
        result["passed"] = (proc.returncode == 0 and counts["tests"] - counts["skipped"] > 0)
    else:
        result["passed"] = False
    return result


def end_to_end(num_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Greedy tokens of the cuda backend against the torch backend on the default model, and
    against the cuda backend without prefix caching (W32's rows share a system prompt, which
    rows admitted in the same step read from blocks that step fills)."""
    import torch

    from batchgen import LLM, SamplingParams

    prompts: list[Any]
    w32 = ROOT / "bench" / "w32.jsonl"
    if w32.exists():
        records = [json.loads(x) for x in w32.read_text().splitlines() if x.strip()]
        prompts = [r["prompt_token_ids"] for r in records[:num_prompts]]
    else:
        prompts = [f"Write one sentence about the number {i}." for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for run in ("torch", "cuda", "cuda_no_prefix_cache"):
        backend = run.split("_")[0]
        llm = LLM(model="smollm2-135m-instruct", dtype="float32", device="cuda",
                  attention_backend=backend, seed=0, enable_prefix_caching=run == backend)
        assert llm.runner.attention_backend == backend, llm.runner.attention_backend
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds[run] = time.perf_counter() - start
        tokens[run] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        torch.cuda.empty_cache()
    same = [a == b for a, b in zip(tokens["torch"], tokens["cuda"])]
    first_diff = []
    for i, (a, b) in enumerate(zip(tokens["torch"], tokens["cuda"])):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first_diff.append({"prompt": i, "position": pos})
    same_cached = [a == b for a, b in zip(tokens["cuda"], tokens["cuda_no_prefix_cache"])]
    return {"passed": all(same) and all(same_cached), "prompts": len(prompts), "identical": sum(same),
            "identical_without_prefix_cache": sum(same_cached),
            "max_tokens": max_tokens, "first_differences": first_diff[:10], "seconds": seconds,
            "tokens_generated": sum(len(t) for t in tokens["cuda"])}


def _time(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event-timed calls, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def sdpa_over_gathered(query, k_cache, v_cache, block_tables, context_lens, scale):
    """The baseline: gather each sequence's blocks densely, then masked SDPA (GQA-native)."""
    import torch
    import torch.nn.functional as F

    from batchgen.kernels.reference import gather_kv

    num_blocks = block_tables.shape[1]
    k, v = gather_kv(k_cache, v_cache, block_tables, num_blocks)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, KVH, L, D]
    pos = torch.arange(k.shape[2], device=query.device)
    mask = (pos[None, :] < context_lens.long()[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def bandwidth(iters: int, budget_s: float) -> dict[str, Any]:
    import torch

    from batchgen.kernels.cuda.attention import get_cuda_ops

    ops = get_cuda_ops()
    dev = torch.device("cuda")
    dtype = torch.float16
    h, kvh, d, bs = (BENCH_SHAPE[k] for k in ("num_heads", "num_kv_heads", "head_size", "block_size"))
    rows = []
    start = time.perf_counter()
    for batch in BATCHES:
        for ctx in CONTEXTS:
            if time.perf_counter() - start > budget_s:
                rows.append({"batch": batch, "context": ctx, "skipped": "time budget"})
                continue
            blocks_per_seq = ctx // bs
            num_blocks = batch * blocks_per_seq
            gen = torch.Generator(device=dev).manual_seed(batch * 100003 + ctx)
            k_cache = torch.randn(num_blocks, bs, kvh, d, device=dev, dtype=dtype, generator=gen)
            v_cache = torch.randn(num_blocks, bs, kvh, d, device=dev, dtype=dtype, generator=gen)
            perm = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
            tables = perm.view(batch, blocks_per_seq).contiguous()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, h, d, device=dev, dtype=dtype, generator=gen)
            scale = d**-0.5
            out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
            base = sdpa_over_gathered(q, k_cache, v_cache, tables, lens, scale)
            max_err = (out.float() - base.float()).abs().max().item()
            t_kernel = _time(lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale), iters)
            t_sdpa = _time(lambda: sdpa_over_gathered(q, k_cache, v_cache, tables, lens, scale), iters)
            moved = 2 * batch * ctx * kvh * d * 2 + 2 * q.numel() * 2 + tables.numel() * 4
            rows.append({
                "batch": batch, "context": ctx, "kernel_us": t_kernel * 1e6, "sdpa_us": t_sdpa * 1e6,
                "speedup_vs_sdpa": t_sdpa / t_kernel, "bytes": moved,
                "kernel_TBps": moved / t_kernel / 1e12,
                "fraction_of_h200_hbm": moved / t_kernel / H200_HBM_BYTES_PER_S,
                "max_abs_diff_vs_sdpa": max_err,
            })
            del k_cache, v_cache, out, base
            torch.cuda.empty_cache()
    measured = [r for r in rows if "kernel_us" in r]
    ok = bool(measured) and all(r["max_abs_diff_vs_sdpa"] < 2e-2 for r in measured)
    return {"passed": ok, "shape": {**BENCH_SHAPE, "dtype": "float16"}, "rows": rows,
            "peak_fraction_of_h200_hbm": max((r["fraction_of_h200_hbm"] for r in measured), default=0.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    parser.add_argument("--test-timeout", type=float, default=240.0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bench-budget", type=float, default=120.0)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["environment"] = environment()
    if not torch.cuda.is_available() or "cupy" not in result["environment"]:
        result["passed"] = False
        result["error"] = "needs a CUDA GPU visible to torch and cupy (pip install 'batchgen[cuda]')"
        args.out.write_text(json.dumps(result, indent=2))
        print(result["error"], file=sys.stderr)
        return 2
    phases = [("kernel_tests", lambda: kernel_tests(args.test_timeout)),
              ("end_to_end", lambda: end_to_end(args.prompts, args.max_tokens)),
              ("bandwidth", lambda: bandwidth(args.iters, args.bench_budget))]
    for name, fn in phases:
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - a failed phase is recorded and the next one runs
            result[name] = {"passed": False, "error": traceback.format_exc()[-4000:]}
        result[name]["wall_s"] = time.perf_counter() - start
        print(f"{name}: {'PASS' if result[name].get('passed') else 'FAIL'} "
              f"({result[name]['wall_s']:.1f} s)", flush=True)
        args.out.write_text(json.dumps(result, indent=2))  # keep partial results
    result["passed"] = all(result[n].get("passed") for n, _ in phases)
    args.out.write_text(json.dumps(result, indent=2))
    if "bandwidth" in result and result["bandwidth"].get("rows"):
        print(f"{'batch':>5} {'ctx':>5} {'kernel us':>10} {'sdpa us':>10} {'TB/s':>6} {'of HBM':>7}")
        for r in result["bandwidth"]["rows"]:
            if "kernel_us" in r:
                print(f"{r['batch']:>5} {r['context']:>5} {r['kernel_us']:>10.1f} {r['sdpa_us']:>10.1f} "
                      f"{r['kernel_TBps']:>6.2f} {r['fraction_of_h200_hbm']:>7.1%}")
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
