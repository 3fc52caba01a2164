"""The ``cpu`` attention backend: paged decode attention in C (``paged_attention.c``).

The CPU counterpart of the CUDA backend. ``paged_attention.c`` is compiled by the system C
compiler (``$CC``, else ``cc`` or ``gcc``) once per (head_size, GQA group), both compile-time
constants, for the machine it runs on (``-march=native``), cached on disk under
``$BATCHGEN_CACHE_DIR/cpu_kernels`` (default ``~/.cache/batchgen``) by a hash of the source,
flags and compiler, and loaded with ctypes. It runs on the calling thread: splitting the batch
over a thread pool measured slower (13 % fewer tokens/s with 2 torch threads), because the pool
competed for the cores with torch's OpenMP workers, which spin between the matmuls.

Why: the torch path (``reference.paged_decode_attention``) first gathers every sequence's blocks
into a dense, padded copy and then runs SDPA over it, reading and writing the context three
times. The kernel reads each K/V row once, in place through the block table, only up to the
sequence's own length, and serves a whole GQA group of query heads per read; on SmolLM2's
shapes it measured 3.0× faster than the torch path at 32 sequences and 3.1× at 128.

Numerics: the result equals the torch path within float32 rounding (the kernel sums in another
order, and its vectorised ``exp`` is within about 2e-7 relative). It is never built with
``-ffast-math``, which would switch the whole process to flush-to-zero. Prefill,
``reshape_and_cache`` and ``copy_blocks`` are the torch reference: prefill is matmul-bound, and
its SDPA call is the one HF makes, so prompt logits stay bit-identical.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from batchgen.kernels import reference

from .loader import CpuKernelError, compiler, load_library

__all__ = ["CpuKernelError", "CpuOps", "KERNEL_SOURCE", "get_cpu_ops", "load", "unsupported_reason"]

KERNEL_SOURCE = Path(__file__).resolve().parent / "paged_attention.c"
MAX_HEAD_SIZE = 512
MAX_GROUP = 16


def unsupported_reason(dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernel cannot serve this model's shape, or None if it can (no compiling)."""
    if dtype != torch.float32:
        return f"dtype {dtype} unsupported; the CPU kernel is float32 only"
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
    fn = lib.batchgen_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]
                   + [ctypes.c_int64] * 2)


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


class CpuOps:
    """The ``cpu`` backend's ops, with :mod:`reference`'s signatures."""

    reshape_and_cache = staticmethod(reference.reshape_and_cache)
    copy_blocks = staticmethod(reference.copy_blocks)
    paged_prefill_attention = staticmethod(reference.paged_prefill_attention)

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        workspace: reference.Workspace | None = None,
    ) -> torch.Tensor:
        """See :func:`reference.paged_decode_attention`; float32 CPU tensors only.

        Raises:
            ValueError: inputs outside the contract (the kernel reads raw memory, so every
                index it would follow is checked first).
        """
        num_seqs, num_heads, head_size = query.shape
        num_blocks, block_size, num_kv_heads, cache_head = k_cache.shape
        for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"paged_decode_attention (cpu): {name} must be a float32 CPU tensor, "
                                 f"got {t.dtype} on {t.device}")
        if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention (cpu): k_cache and v_cache must be contiguous "
                             "and of one shape")
        if cache_head != head_size or num_heads % num_kv_heads:
            raise ValueError(f"paged_decode_attention (cpu): query {tuple(query.shape)} does not fit "
                             f"the cache {tuple(k_cache.shape)}")
        out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float32)
        if num_seqs == 0:
            return out
        if query.stride(2) != 1:
            query = query.contiguous()
        tables = block_tables.to(torch.int32).contiguous()  # no copies for the engine's own
        lens = context_lens.to(torch.int32).contiguous()
        if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            raise ValueError(f"paged_decode_attention (cpu): {num_seqs} queries but block_tables "
                             f"{tuple(tables.shape)} and context_lens {tuple(lens.shape)}")
        max_blocks = tables.shape[1]
        group = num_heads // num_kv_heads
        fn = load(head_size, group).batchgen_paged_decode_f32
        # Room for the longest context the tables allow, so no reduction over lens is needed.
        shape = (max(max_blocks, 1) * block_size * group,)
        scratch = (workspace.get("cpu_scores", shape, torch.float32, k_cache.device)
                   if workspace is not None else torch.empty(shape, dtype=torch.float32))
        # The kernel checks every index it would follow before computing anything.
        status = fn(out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    tables.data_ptr(), lens.data_ptr(), num_seqs, num_kv_heads, block_size, max_blocks,
                    query.stride(0), query.stride(1), float(scale), scratch.data_ptr(), num_blocks,
                    shape[0])
        if status == 1:
            raise ValueError(f"paged_decode_attention (cpu): context_lens must be in [1, "
                             f"{max_blocks * block_size}] (the block tables' width)")
        if status == 2:
            # Only entries a sequence reads must be valid; padding past them is never read.
            raise ValueError(f"paged_decode_attention (cpu): block table entries must be in [0, {num_blocks})")
        return out


_ops: CpuOps | None = None


def get_cpu_ops() -> CpuOps:
    """The ``cpu`` backend's ops (one shared instance)."""
    global _ops
    if _ops is None:
        _ops = CpuOps()
    return _ops
