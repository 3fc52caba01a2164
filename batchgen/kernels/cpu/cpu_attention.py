"""The ``cpu`` attention backend: paged attention in C (``paged_attention.c``), decode and prefill.

The CPU counterpart of the CUDA backend. ``paged_attention.c`` is compiled by the system C
compiler (``$CC``, else ``cc`` or ``gcc``) once per (head_size, GQA group), both compile-time
constants, for the machine it runs on (``-march=native``), cached on disk under
``$BATCHGEN_CACHE_DIR/cpu_kernels`` (default ``~/.cache/batchgen``) by a hash of the source,
flags and compiler, and loaded with ctypes. The work is split over (sequence, query tile, KV
head) items on batchgen's thread pool.

Why: the torch path (``torch_attention.py``) first gathers every sequence's blocks into a dense,
padded copy and then runs SDPA over it, reading and writing the context three times. The kernel
reads each K/V row in place through the block table, only up to the query's own position, and
serves a whole GQA group of query heads (and, in prefill, a tile of query tokens) per read.

Numerics: one routine computes every query row, decode or prefill, with the same arithmetic in
a fixed order (see the C source): a token's output does not depend on the batch, the prefill
chunking, whether it is computed by decode or recomputed by prefill, or the thread count. It
equals the torch path within float32 rounding (another summation order, and a vectorised
``exp`` within about 2e-7 relative); float16 and bfloat16 caches are read into float32 and the
output rounded once. Never built with ``-ffast-math``, which would switch the whole process to
flush-to-zero. ``reshape_and_cache`` and ``copy_blocks`` are the torch reference's (copies).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from batchgen.kernels import torch_attention

from .c_build import CpuKernelError, compiler, load_library

__all__ = ["CpuKernelError", "CpuOps", "KERNEL_SOURCE", "get_cpu_ops", "load", "paged_attention",
           "unsupported_reason"]

KERNEL_SOURCE = Path(__file__).resolve().parent / "paged_attention.c"
MAX_HEAD_SIZE = 512
MAX_GROUP = 16
# dtype codes of the C entry point
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def unsupported_reason(dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernel cannot serve this model's shape, or None if it can (no compiling)."""
    if dtype not in DTYPES:
        return f"dtype {dtype} unsupported; the CPU kernel takes float32, bfloat16 and float16"
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        return f"head_size {head_size} unsupported; at most {MAX_HEAD_SIZE}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per KV head unsupported; at most {MAX_GROUP}"
    if compiler() is None:
        return "no C compiler found (set CC, or install gcc)"
    return None


def _declare_attention(lib: Any) -> None:
    fn = lib.batchgen_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64,
                                                                     ctypes.c_int, ctypes.c_int,
                                                                     ctypes.c_int64, ctypes.c_float])


def load(head_size: int, group: int) -> Any:
    """The compiled kernel library for this shape (built on first use, then cached).

    Raises:
        CpuKernelError: no compiler, or no flag set compiled; the message has the last error.
    """
    def accept(lib: Any) -> str | None:
        ok = lib.batchgen_head_size() == head_size and lib.batchgen_group() == group
        return None if ok else "built for another shape"

    return load_library("the CPU attention kernel", KERNEL_SOURCE, _declare_attention,
                        (f"-DHEAD_SIZE={head_size}", f"-DGROUP={group}"), accept,
                        tag=f"h{head_size}-g{group}")


# (head_size, group) -> the loaded kernel's entry point: a decode step calls the kernel once per
# layer, so the per-call Python work is kept to the checks the kernel needs.
_entry_points: dict[tuple[int, int], Any] = {}


def _entry_point(head_size: int, group: int) -> Any:
    fn = _entry_points.get((head_size, group))
    if fn is None:
        fn = _entry_points[(head_size, group)] = load(head_size, group).batchgen_paged_attention
    return fn


ERRORS = {
    1: "context_lens must be in [1, {width}] (the block tables' width)",
    # Only entries a sequence reads must be valid; padding past them is never read.
    2: "block table entries must be in [0, {num_blocks})",
    3: "query_start_loc must rise from 0 to the number of query tokens, each sequence's "
       "query no longer than its context",
    4: "out of memory for the kernel's scratch",
    6: "sliding_window must be >= 0 and logits_soft_cap a number >= 0",
}


def _check_tensors(op: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The query's and the caches' dtypes, devices, layout and shapes, or a ValueError naming
    ``op`` and what does not fit."""
    dtype = query.dtype
    if dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype or not (
            query.device.type == k_cache.device.type == v_cache.device.type == "cpu"):
        for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype not in DTYPES or t.device.type != "cpu":
                raise ValueError(f"{op} (cpu): {name} must be a float32, bfloat16 or float16 CPU "
                                 f"tensor, got {t.dtype} on {t.device}")
        raise ValueError(f"{op} (cpu): k_cache and v_cache must have one dtype, got "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op} (cpu): k_cache and v_cache must be contiguous and of one shape")
    if k_cache.shape[3] != query.shape[2] or query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{op} (cpu): query {tuple(query.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)}")


def _index_tensors(op: str, num_tokens: int, block_tables: torch.Tensor, query_start_loc: torch.Tensor | None,
                   context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The block tables, query starts (None for decode) and context lengths as int32 (no copies
    for the engine's own), their shapes checked against each other and ``num_tokens``."""
    tables, lens = as_int32(block_tables), as_int32(context_lens)
    num_seqs = lens.shape[0] if lens.dim() == 1 else -1
    starts = None
    if query_start_loc is not None:
        starts = as_int32(query_start_loc)
        if starts.shape != (num_seqs + 1,):
            raise ValueError(f"{op} (cpu): query_start_loc {tuple(starts.shape)} does not fit "
                             f"context_lens {tuple(lens.shape)}")
    elif num_seqs != num_tokens:
        raise ValueError(f"{op} (cpu): {num_tokens} queries but context_lens {tuple(lens.shape)}")
    if tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"{op} (cpu): {num_seqs} sequences but block_tables {tuple(tables.shape)}")
    return tables, starts, lens


def paged_attention(
    op: str,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Both ops in one call: decode when ``query_start_loc`` is None (one query row per
    sequence), else prefill (see :func:`torch_attention.paged_prefill_attention`, also for the
    window and the soft cap). ``op`` names the caller in errors.

    Raises:
        ValueError: inputs outside the contract (the kernel reads raw memory, so every index it
            would follow is checked first).
    """
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    dtype = query.dtype
    _check_tensors(op, query, k_cache, v_cache)
    out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype)
    tables, starts, lens = _index_tensors(op, num_tokens, block_tables, query_start_loc, context_lens)
    num_seqs = lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    max_blocks = tables.shape[1]
    fn = _entry_point(head_size, num_heads // num_kv_heads)
    # The kernel checks every index it would follow before computing anything.
    q_stride_tok, q_stride_head, _ = query.stride()
    status = fn(out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                tables.data_ptr(), None if starts is None else starts.data_ptr(), lens.data_ptr(),
                num_seqs, num_tokens, num_kv_heads, block_size, max_blocks, q_stride_tok,
                q_stride_head, float(scale), num_blocks, DTYPES[dtype], DTYPES[k_cache.dtype],
                int(sliding_window or 0),
                float(logits_soft_cap or 0.0))
    if status:
        message = ERRORS.get(status, f"kernel error {status}")
        raise ValueError(f"{op} (cpu): " + message.format(width=max_blocks * block_size,
                                                            num_blocks=num_blocks))
    return out


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor (itself when it already is one)."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


class CpuOps:
    """The ``cpu`` backend's :class:`~batchgen.kernels.ops.AttentionOps`."""

    reshape_and_cache = staticmethod(torch_attention.reshape_and_cache)
    copy_blocks = staticmethod(torch_attention.copy_blocks)

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        workspace: torch_attention.Workspace | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See :func:`torch_attention.paged_decode_attention` (``workspace`` is not needed).

        Raises:
            ValueError: inputs outside the contract.
        """
        return paged_attention("paged_decode_attention", query, k_cache, v_cache, block_tables,
                               None, context_lens, scale, sliding_window, logits_soft_cap)

    def paged_prefill_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        workspace: torch_attention.Workspace | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See :func:`torch_attention.paged_prefill_attention` (``workspace`` is not needed).

        Raises:
            ValueError: inputs outside the contract.
        """
        return paged_attention("paged_prefill_attention", query, k_cache, v_cache, block_tables,
                               query_start_loc, context_lens, scale, sliding_window, logits_soft_cap)


_ops: CpuOps | None = None


def get_cpu_ops() -> CpuOps:
    """The ``cpu`` backend's ops (one shared instance)."""
    global _ops
    if _ops is None:
        _ops = CpuOps()
    return _ops
