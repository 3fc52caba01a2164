"""The GPU check's ``correctness`` stage (run by ``bench/gpu_check.py`` in a subprocess): the
``cuda`` ops against the torch backend on a grid of dtypes, head sizes and GQA groups with ragged
contexts and a long one, the cache ops bit for bit, the index checks on the device (bad values
raise and the context is still usable) and one check's cost. The device and the decode cases come
from :mod:`bench.gpu_kernel_stages` (read at call time: a test sets its ``DEVICE`` to the CPU
harness); it stops with :func:`bench.gpu_common.gpu_point` before its first CUDA call when there
is no GPU (the dry run).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import gpu_kernel_stages as ks
from bench.gpu_common import Stage, gpu_point

CHECK_HEAD_SIZES = (64, 80, 96, 128, 256)
CHECK_GROUPS = (1, 2, 3, 4, 8)
CHECK_DTYPES = ("float32", "float16", "bfloat16")
LONG_CONTEXT = 9217  # 37 split-K partitions, one past a block edge
RAGGED_LENS = (1, 15, 16, 17, 300, 257)  # within, at and just past block and partition edges
# (head_size, GQA group, context lengths, block size), run in every dtype besides the grid
EXTRA_CASES = ((128, 4, (LONG_CONTEXT, 3, 600), 16), (64, 8, (LONG_CONTEXT,), 32), (96, 2, (9, 130, 1000), 8))


def _check_cases() -> list[tuple[str, int, int, list[int], int]]:
    """The decode cases of the correctness stage: (dtype, head size, group, context lens, block size)."""
    cases = []
    for dtype_name in CHECK_DTYPES:
        for head in CHECK_HEAD_SIZES:
            for group in CHECK_GROUPS:
                cases.append((dtype_name, head, group, list(RAGGED_LENS), 16))
        cases += [(dtype_name, head, group, list(lens), bs) for head, group, lens, bs in EXTRA_CASES]
    return cases


def _decode_rows(stage: Stage, ops: Any, dev: Any, cases: list, rows: list[dict[str, Any]]) -> None:
    """Each decode case against the torch reference in float32, one row each into ``rows``
    (saved as it goes; skipped once the stage's time is nearly spent)."""
    from batchgen.kernels import torch_attention as reference

    for i, (dtype_name, head, group, lens, bs) in enumerate(cases):
        if stage.left() < 5:
            rows.append({"dtype": dtype_name, "head_size": head, "group": group, "skipped": "time budget"})
            continue
        q, k, v, tables, lens_t = ks._decode_case(lens, 2 * group, 2, head, bs, ks._dtype(dtype_name), dev, seed=i)
        scale = head ** -0.5
        out = ops.paged_decode_attention(q, k, v, tables, lens_t, scale)
        want = reference.paged_decode_attention(q.float(), k.float(), v.float(), tables, lens_t, scale)
        diff = (out.float() - want).abs()
        tol = ks.TOLERANCES[dtype_name]
        within = bool((diff <= tol + tol * want.abs()).all())  # as torch.testing.assert_close
        rows.append({"dtype": dtype_name, "head_size": head, "group": group, "block_size": bs,
                     "context_lens": lens, "max_abs_diff": diff.max().item(), "atol_rtol": tol,
                     "passed": within})
        stage.save()


def _cache_ops_exact(ops: Any, dev: Any) -> bool:
    """The cache ops (reshape_and_cache, copy_blocks) equal the reference's, one shape per dtype."""
    import torch

    from batchgen.kernels import torch_attention as reference

    cache_ok = []
    for dtype_name in CHECK_DTYPES:
        dtype = ks._dtype(dtype_name)
        gen = torch.Generator().manual_seed(11)
        kv = torch.randn(2, 2, 12, 16, 2, 128, generator=gen).to(dtype).to(dev)
        key = torch.randn(9, 2, 128, generator=gen).to(dtype).to(dev)
        val = torch.randn(9, 2, 128, generator=gen).to(dtype).to(dev)
        slots = torch.tensor([5, 17, -1, 40, 41, 100, 191, 0, 63], device=dev)
        got_k, got_v = kv[0, 0].clone(), kv[0, 1].clone()
        want_k, want_v = got_k.clone(), got_v.clone()
        ops.reshape_and_cache(key, val, got_k, got_v, slots)
        keep = slots >= 0
        reference.reshape_and_cache(key[keep], val[keep], want_k, want_v, slots[keep])
        mapping = torch.tensor([[0, 7], [3, 8], [3, 9], [5, 1]], device=dev)
        got_kv, want_kv = kv.clone(), kv.clone()
        ops.copy_blocks(got_kv, mapping)
        reference.copy_blocks(want_kv, mapping)
        cache_ok.append(torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and torch.equal(got_kv, want_kv))
    return all(cache_ok)


def _index_checks(ops: Any, dev: Any) -> dict[str, Any]:
    """The index checks on the device: bad values raise, and the context is still usable after."""
    import torch

    from batchgen.kernels.cuda.cuda_attention import KernelInputError

    q, k, v, tables, lens_t = ks._decode_case([40, 9], 8, 2, 128, 16, torch.float16, dev, seed=99)
    raised = []
    for bad_tables, bad_lens in ((tables.clone().index_fill_(1, torch.tensor([0], device=dev), k.shape[0]), lens_t),
                                 (tables, lens_t + tables.shape[1] * 16)):
        try:
            ops.paged_decode_attention(q, k, v, bad_tables, bad_lens, 0.1)
            raised.append(None)
        except KernelInputError as exc:
            raised.append(str(exc))
    try:
        ops.reshape_and_cache(q[:, :2], q[:, :2], k, v, torch.tensor([0, k.shape[0] * 16], device=dev))
        raised.append(None)
    except KernelInputError as exc:
        raised.append(str(exc))
    after = ops.paged_decode_attention(q, k, v, tables, lens_t, 0.1)
    ks._sync()
    return {"messages": raised, "all_raised": all(raised), "gpu_usable_after": bool(torch.isfinite(after).all().item())}


def _check_cost_us(dev: Any) -> float:
    """The median cost of one index check on the largest tables of the sweep (one host sync)."""
    import torch

    from batchgen.kernels.cuda import checks

    big_tables = torch.randint(0, 2**20, (256, 1024), dtype=torch.int32, device=dev)
    big_lens = torch.full((256,), 16384, dtype=torch.int32, device=dev)
    times = []
    for _ in range(20):
        ks._sync()
        t = time.perf_counter()
        checks.context_violation(big_tables, big_lens, 2**20, 16)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def stage_correctness(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch

    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops

    dev = torch.device(ks.DEVICE)
    cases = _check_cases()
    rows: list[dict[str, Any]] = []
    stage.data.update(rows=rows, cases=len(cases))
    gpu_point(f"cupy and the first of {len(cases)} decode cases on {ks.DEVICE}", ks.DEVICE)
    ops = get_cuda_ops()
    _decode_rows(stage, ops, dev, cases, rows)
    stage.data["cache_ops_exact"] = _cache_ops_exact(ops, dev)
    stage.data["index_checks"] = _index_checks(ops, dev)
    stage.data["index_check_us_256x16K"] = _check_cost_us(dev)
    measured = [r for r in rows if "passed" in r]
    failed = [r for r in measured if not r["passed"]]
    stage.data["passed"] = (bool(measured) and not failed and len(measured) == len(cases)
                            and stage.data["cache_ops_exact"] and stage.data["index_checks"]["all_raised"]
                            and stage.data["index_checks"]["gpu_usable_after"])
    stage.data["summary"] = (f"{len(measured) - len(failed)}/{len(cases)} decode cases within tolerance, "
                             f"cache ops exact: {stage.data['cache_ops_exact']}, "
                             f"bad indices raised: {stage.data['index_checks']['all_raised']}")
