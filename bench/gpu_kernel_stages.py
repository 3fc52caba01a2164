"""The GPU check's kernel stages (run by ``bench/gpu_check.py``, one subprocess each).

``kernel_tests`` (the kernel tests' GPU cases), ``bandwidth`` (the decode kernel's achieved bandwidth beside SDPA's flash
kernel) and ``flashinfer`` (FlashInfer's paged decode on the same points), and what they share
with ``correctness`` (``bench/gpu_correctness.py``): the device and a decode case's inputs; see
``bench/gpu_check.py``'s docstring for what each measures. Each stops with
:func:`bench.gpu_common.gpu_point` before its first CUDA call when there is no GPU (the dry run).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.gpu_common import (
    BENCH_BLOCK_SIZE,
    BENCH_NUM_HEADS,
    BENCH_NUM_KV_HEADS,
    ROOT,
    Stage,
    bench_points,
    decode_bytes,
    gpu_point,
    is_target,
)

# Output against the float32 reference: about two units in the last place of the dtype.
TOLERANCES = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

# The device the stages run on ("cpu" lets the correctness stage be tried on the CPU harness).
DEVICE = "cuda"


def _sync() -> None:
    import torch

    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _decode_case(batch_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                 dtype, device, seed: int, spare_blocks: int = 3):
    """``[query, k_cache, v_cache, block_tables, context_lens]`` on ``device``: random data
    (drawn on the device), each sequence's blocks scattered over the pool by a permutation, and
    one more table column of garbage that no kernel may read."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(n / block_size) for n in batch_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # Block 0 pads short rows up to the longest (the torch reference gathers that far).
    tables = torch.zeros(len(batch_lens), max(need) + 1, dtype=torch.int32)
    tables[:, -1] = 2**30
    pos = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[pos:pos + n]
        pos += n
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    q = torch.randn(len(batch_lens), num_heads, head_size, generator=dev_gen, device=device, dtype=dtype)
    return [q, k, v, tables.to(device), torch.tensor(batch_lens, dtype=torch.int32, device=device)]


def stage_kernel_tests(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import xml.etree.ElementTree as ET

    import torch

    report = stage.path.with_name("junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu",
           f"--junitxml={report}", "tests/kernels/test_kernels.py"]
    if not torch.cuda.is_available():  # the dry run: the GPU cases must at least be collected
        proc = subprocess.run(cmd[:-2] + ["--collect-only", cmd[-1]], cwd=ROOT, capture_output=True, text=True,
                              timeout=max(5.0, stage.left()))
        stage.data["collected"] = (proc.stdout.strip().splitlines() or ["?"])[-1]
        if proc.returncode != 0:
            stage.data["error"] = (proc.stdout + proc.stderr)[-2000:]
            return
    gpu_point("running the GPU cases of tests/kernels/test_kernels.py")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(5.0, stage.left()))
    except subprocess.TimeoutExpired:
        stage.data["error"] = "pytest ran out of the stage's time"
        return
    stage.data["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
    if report.exists():
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        stage.data.update(counts)
        stage.data["passed"] = proc.returncode == 0 and counts["tests"] - counts["skipped"] > 0
        stage.data["summary"] = f"{counts['tests'] - counts['skipped']} run, {counts['failures']} failed"


def gpu_time(fn: Callable[[int], Any], iters: int, repeats: int, clock_khz: int | None) -> list[float]:
    """Seconds per call of ``fn(i)``, one figure per repeat, with the host's time excluded.

    Each repeat queues a sleep kernel first, long enough to cover the host's enqueueing of all
    ``iters`` calls (measured on a warm-up), then the start event, the calls, the end event: the
    GPU reaches the calls only once they are all queued, so they run back to back and the
    events time the GPU alone. ``fn`` must not synchronise.
    """
    import torch

    fn(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(iters):
        fn(i)
    enqueue = time.perf_counter() - t  # the host's share (the GPU may still be running)
    torch.cuda.synchronize()
    # twice the enqueue time, plus 0.1 ms; an unknown clock is taken as 2 GHz (a slower real
    # clock only lengthens the sleep)
    cycles = int(min((2 * enqueue + 1e-4) * (clock_khz or 2_000_000) * 1e3, 2**40))
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / iters)
    return out


def _copies(bytes_per_copy: int, l2_bytes: int | None) -> int:
    """How many copies of the inputs to rotate through so that no call finds them in L2."""
    l2 = l2_bytes or 64 * 2**20
    return max(1, min(64, math.ceil(4 * l2 / max(1, bytes_per_copy))))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _sweep(stage: Stage, env: dict[str, Any], measure: Callable[[dict[str, Any], dict[str, Any]], None]) -> list:
    """Run ``measure(row, inputs)`` on every sweep point while the stage has time.

    ``inputs`` holds the point's ``dtype``, ``bytes`` per call, the ``copies`` rotated over (so
    that no call finds its inputs in L2) and their ``sets`` of decode arguments. A point that
    fails is recorded with its error and the sweep goes on; results are saved after each point.
    """
    import torch

    rows: list[dict[str, Any]] = []
    stage.data["rows"] = rows
    for point in bench_points():
        if stage.left() < 8:
            rows.append({**point, "skipped": "time budget"})
            continue
        row: dict[str, Any] = {**point}
        inputs: dict[str, Any] = {}
        try:
            dtype = _dtype(point["dtype"])
            b, ctx, head = point["batch"], point["context"], point["head_size"]
            moved = decode_bytes(b, ctx, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE, dtype.itemsize)
            n = _copies(moved, env.get("l2_bytes"))
            inputs = {"dtype": dtype, "bytes": moved, "copies": n, "sets": [
                _decode_case([ctx] * b, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE, dtype,
                             torch.device("cuda"), seed=1000 + j, spare_blocks=0) for j in range(n)]}
            measure(row, inputs)
        except Exception as exc:  # noqa: BLE001 - recorded per point; the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        rows.append(row)
        inputs.clear()
        torch.cuda.empty_cache()
        stage.save()
    return rows


def stage_bandwidth(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch.nn.functional as F

    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops
    from batchgen.kernels.torch_attention import gather_kv

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        SDPBackend = sdpa_kernel = None
    peak = env.get("peak_bytes_per_s")
    clock = env.get("sm_clock_khz")
    gpu_point(f"cupy and the first of {len(bench_points())} sweep points")
    ops = get_cuda_ops(check_indices=False)  # timing: the checks are a per-step host sync, measured apart
    stage.data.update(peak_bytes_per_s=peak, method="CUDA events around iters back-to-back calls "
                      "queued behind a sleep kernel; inputs rotated over copies larger than L2",
                      shape={"num_heads": BENCH_NUM_HEADS, "num_kv_heads": BENCH_NUM_KV_HEADS,
                             "block_size": BENCH_BLOCK_SIZE}, index_checks=False)

    def measure(row: dict[str, Any], inputs: dict[str, Any]) -> None:
        ctx, scale = row["context"], row["head_size"] ** -0.5
        sets, n, moved = inputs["sets"], inputs["copies"], inputs["bytes"]
        row.update(bytes=moved, copies=n)
        times = gpu_time(lambda i: ops.paged_decode_attention(*sets[i % n], scale), args.iters, args.repeats, clock)
        row.update(kernel_us=_median(times) * 1e6, kernel_range_us=[min(times) * 1e6, max(times) * 1e6])
        row["kernel_TBps"] = moved / _median(times) / 1e12
        row["fraction_of_peak"] = moved / _median(times) / peak if peak else None
        if sdpa_kernel is None:
            return
        dense = []  # SDPA reads the cache already gathered: the dense peer's best case
        for q, k, v, tables, _lens in sets:
            kd, vd = gather_kv(k, v, tables, math.ceil(ctx / BENCH_BLOCK_SIZE))
            dense.append((q.unsqueeze(2), kd[:, :ctx].transpose(1, 2).contiguous(),
                          vd[:, :ctx].transpose(1, 2).contiguous()))
            del kd, vd

        def sdpa(i: int) -> Any:
            q, kd, vd = dense[i % n]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kd, vd, scale=scale, enable_gqa=True)

        try:
            ref = sdpa(0).squeeze(2)
            row["max_abs_diff_vs_sdpa"] = (ops.paged_decode_attention(*sets[0], scale).float()
                                           - ref.float()).abs().max().item()
            t_sdpa = gpu_time(sdpa, args.iters, args.repeats, clock)
            row.update(sdpa_us=_median(t_sdpa) * 1e6, sdpa_range_us=[min(t_sdpa) * 1e6, max(t_sdpa) * 1e6],
                       kernel_vs_sdpa=_median(times) / _median(t_sdpa))
        except RuntimeError as exc:  # flash may refuse a shape or GQA on this torch
            row["sdpa_error"] = f"{exc}".splitlines()[0][:200]

    rows = _sweep(stage, env, measure)
    measured = [r for r in rows if "kernel_us" in r]
    diffs_ok = all(r.get("max_abs_diff_vs_sdpa", 0) < TOLERANCES[r["dtype"]] * 8 for r in measured)
    stage.data["passed"] = bool(measured) and diffs_ok and not any("error" in r for r in rows)
    target = [r for r in measured if is_target(r) and r.get("fraction_of_peak") is not None]
    stage.data["summary"] = (f"{len(measured)}/{len(rows)} points; at batch>=64, ctx>=1K: "
                             f"{min(r['fraction_of_peak'] for r in target):.0%}-"
                             f"{max(r['fraction_of_peak'] for r in target):.0%} of peak" if target
                             else f"{len(measured)}/{len(rows)} points")


def stage_flashinfer(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch

    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops

    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - not installable here: say why and move on
        stage.data.update(skipped=f"FlashInfer unavailable ({type(exc).__name__}: {exc}); not carried to the "
                          "GPU machine (flashinfer-python 0.7.4 is a 101 MB wheel, over the 64 MiB a call "
                          "carries): SDPA's flash kernel is the bandwidth stage's peer", passed=True)
        return
    gpu_point("FlashInfer's first call")
    dev = torch.device("cuda")
    clock = env.get("sm_clock_khz")
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    stage.data["flashinfer"] = getattr(flashinfer, "__version__", "?")

    def measure(row: dict[str, Any], inputs: dict[str, Any]) -> None:
        b, ctx, head = row["batch"], row["context"], row["head_size"]
        sets, n, dtype = inputs["sets"], inputs["copies"], inputs["dtype"]
        pages = math.ceil(ctx / BENCH_BLOCK_SIZE)
        # Every copy's pool has the same number of blocks, so copy 0's tables are valid for all
        # of them: one plan serves every copy.
        indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32, device=dev)
        last = torch.full((b,), ctx - (pages - 1) * BENCH_BLOCK_SIZE, dtype=torch.int32, device=dev)
        indices = sets[0][3][:, :pages].reshape(-1).contiguous()
        best = None
        for tensor_cores in (False, True):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
            w.plan(indptr, indices, last, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE,
                   q_data_type=dtype, kv_data_type=dtype, sm_scale=head ** -0.5)

            def call(i: int, w=w) -> Any:
                q_i, k_i, v_i = sets[i % n][:3]
                return w.run(q_i, (k_i, v_i))

            if not tensor_cores:  # FlashInfer's output agrees with the kernel's on copy 0
                q0, k0, v0 = sets[0][:3]
                ours = get_cuda_ops(check_indices=False).paged_decode_attention(
                    q0, k0, v0, indices.view(b, pages), sets[0][4], head ** -0.5)
                row["max_abs_diff_vs_kernel"] = (call(0).float() - ours.float()).abs().max().item()
            times = gpu_time(call, args.iters, args.repeats, clock)
            if best is None or _median(times) < _median(best[0]):
                best = (times, tensor_cores)
        times, tensor_cores = best
        row.update(flashinfer_us=_median(times) * 1e6, flashinfer_range_us=[min(times) * 1e6, max(times) * 1e6],
                   flashinfer_TBps=inputs["bytes"] / _median(times) / 1e12, use_tensor_cores=tensor_cores)

    rows = _sweep(stage, env, measure)
    measured = [r for r in rows if "flashinfer_us" in r]
    # Same numbers as the kernel's (a wrong call would make the timing meaningless).
    stage.data["passed"] = bool(measured) and all(
        r.get("max_abs_diff_vs_kernel", 0) < TOLERANCES[r["dtype"]] * 8 for r in measured)
    stage.data["summary"] = f"{len(measured)}/{len(rows)} points timed"
