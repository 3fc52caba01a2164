"""The CUDA attention backend: paged-attention kernels compiled at runtime and launched on torch.

``paged_attention.cu`` is compiled once per (dtype, head_size, block_size) with
``cupy.RawModule`` (NVRTC; cupy's on-disk cache makes later processes skip compilation) and
launched on torch's current CUDA stream, tensors passed through DLPack. The same launch code,
:class:`KernelOps`, also drives the CPU harness in the tests (``tests/kernels/cuda_harness``,
through a :class:`Backend` of its own), so what is tested on a CPU is exactly the argument
packing, grid and shared-memory sizing that runs on a GPU.

The source, the constants mirrored from its header, the launch sizing and the runtimes
(:class:`Backend`, :class:`CupyBackend`) are in :mod:`.kernel_build`, re-exported here; cupy is
imported only inside :class:`CupyBackend` there and inside :mod:`.toolchain`'s functions (which
finds NVRTC's headers). :mod:`.checks` checks the values of the indices the kernels follow.

Split-K rule: a sequence of context length ``n`` is processed in ``ceil(n / PARTITION_SIZE)``
partitions. One partition (``n <= PARTITION_SIZE``) is the single-pass kernel: the block writes
the output directly. More partitions are reduced by ``paged_decode_reduce``. The choice depends
only on the sequence's own ``n``, so its output is bitwise the same whatever else is in the batch.

Prefill uses :func:`torch_attention.paged_prefill_attention` (SDPA over gathered blocks): prefill is
compute-bound and SDPA's fused kernels already do it well; the gather is one extra read of the
prefix, which prefills amortise over many query tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from batchgen.kernels import torch_attention

from . import checks
from .kernel_build import (  # noqa: F401  (the rest re-exported: the old import path of each)
    BLOCK_SIZES,
    COPY_THREADS,
    DTYPE_CODES,
    HEAD_SIZES,
    KERNEL_DIR,
    KERNEL_HEADER,
    KERNEL_SOURCE,
    MAX_GROUP,
    NUM_THREADS,
    NUM_WARPS,
    PARTITION_SIZE,
    TILE,
    _SINGLE_PASS,
    Backend,
    CupyBackend,
    decode_smem_bytes,
    full_source,
    module_defines,
    num_partitions,
    reduce_smem_bytes,
)
from .toolchain import nvrtc_include_dirs  # noqa: F401  (re-exported: where NVRTC's headers are)


class KernelInputError(ValueError):
    """Inputs of a kernel op violate its contract (dtype, device, layout or shape)."""


def _fail(op: str, msg: str) -> KernelInputError:
    return KernelInputError(f"{op}: {msg}")


class KernelOps:
    """The four ops of ``torch_attention.py`` with the same signatures, running the CUDA kernels.

    Every op checks its inputs before launching (a bad pointer or shape on a GPU is silent
    memory corruption) and raises :class:`KernelInputError` naming the op and the argument.

    With ``check_indices`` (the default) the values of the indices the kernels follow are
    checked too (:mod:`.checks`: context lengths, block ids, slots), one host sync per new set
    of index tensors; ``False`` skips that, for callers that guarantee them (the engine's
    ``index_checks: false``) and for timing.
    """

    def __init__(self, backend: Backend, check_indices: bool = True) -> None:
        self.backend = backend
        self.check_indices = check_indices
        self._checked = checks.CheckedOnce()

    def _check_values(self, op: str, name: str, tensors: tuple[torch.Tensor, ...],
                      extra: tuple[Any, ...], check: Callable[[], str | None]) -> None:
        """Run ``check`` unless disabled or already passed for these very tensors."""
        if not self.check_indices or self._checked.seen(name, tensors, extra):
            return
        why = check()
        if why is not None:
            raise _fail(op, why)
        self._checked.remember(name, tensors, extra)

    # ------------------------------------------------------------------ checks
    def _check_tensor(
        self,
        op: str,
        name: str,
        t: Any,
        *,
        ndim: int,
        dtypes: tuple[torch.dtype, ...],
        device: torch.device | None,
        contiguous: bool = True,
    ) -> None:
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise _fail(op, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d) for d in dtypes)
            raise _fail(op, f"{name} must have dtype {allowed}; got {t.dtype}")
        if t.device.type != self.backend.device_type:
            raise _fail(op, f"{name} must be on a {self.backend.device_type} device, got {t.device}")
        if device is not None and t.device != device:
            raise _fail(op, f"{name} is on {t.device} but the other inputs are on {device}")
        if contiguous and not t.is_contiguous():
            raise _fail(op, f"{name} must be contiguous")

    def _check_pool(self, op: str, k_cache: Any, v_cache: Any, device: torch.device | None) -> None:
        for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
            self._check_tensor(op, name, pool, ndim=4, dtypes=tuple(DTYPE_CODES), device=device)
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
            raise _fail(op, f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                            f"{tuple(v_cache.shape)} {v_cache.dtype} must match")
        _, block_size, _, head_size = k_cache.shape
        if block_size not in BLOCK_SIZES:
            raise _fail(op, f"block_size {block_size} unsupported; supported: {BLOCK_SIZES}")
        if head_size not in HEAD_SIZES:
            raise _fail(op, f"head_size {head_size} unsupported; supported: {HEAD_SIZES}")

    # ------------------------------------------------------------------ ops
    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """See :func:`torch_attention.reshape_and_cache`. Negative slots are skipped (padding)."""
        op = "reshape_and_cache"
        self._check_pool(op, k_cache, v_cache, None)
        device = k_cache.device
        num_blocks, block_size, kv_heads, head_size = k_cache.shape
        for name, t in (("key", key), ("value", value)):
            self._check_tensor(op, name, t, ndim=3, dtypes=tuple(DTYPE_CODES), device=device,
                               contiguous=False)
            if tuple(t.shape[1:]) != (kv_heads, head_size):
                raise _fail(op, f"{name} must be [num_tokens, {kv_heads}, {head_size}], got "
                                f"{tuple(t.shape)}")
        self._check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,),
                           device=device)
        num_tokens = key.shape[0]
        if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
            raise _fail(op, f"key, value and slot_mapping disagree on num_tokens: {key.shape[0]}, "
                            f"{value.shape[0]}, {slot_mapping.shape[0]}")
        if num_tokens == 0:
            return
        num_slots = num_blocks * block_size
        self._check_values(op, "slots", (slot_mapping,), (num_slots,),
                           lambda: checks.slot_violation(slot_mapping, num_slots))
        # The kernel reads rows at any stride but each [kv_heads, head_size] row must be dense.
        key = key.to(k_cache.dtype)
        value = value.to(v_cache.dtype)
        if key.stride(2) != 1 or key.stride(1) != head_size:
            key = key.contiguous()
        if value.stride(2) != 1 or value.stride(1) != head_size:
            value = value.contiguous()
        mod = self.backend.module(k_cache.dtype, head_size, block_size)
        b = self.backend
        with b.launch_context(device):
            mod.get_function("reshape_and_cache")(
                (num_tokens,), (NUM_THREADS,),
                (b.arg(_rows(key)), b.arg(_rows(value)), b.arg(k_cache), b.arg(v_cache),
                 b.arg(slot_mapping), np.int32(kv_heads), np.int64(key.stride(0)),
                 np.int64(value.stride(0))),
            )

    def copy_blocks(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """See :func:`torch_attention.copy_blocks`: every pair, K and V, all layers, one launch."""
        op = "copy_blocks"
        self._check_tensor(op, "kv_cache", kv_cache, ndim=6, dtypes=tuple(DTYPE_CODES), device=None)
        num_layers, two, num_blocks, block_size, kv_heads, head_size = kv_cache.shape
        if two != 2:
            raise _fail(op, f"kv_cache dimension 1 must be 2 (K, V), got {two}")
        self._check_tensor(op, "block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,),
                           device=kv_cache.device)
        if block_mapping.shape[1] != 2:
            raise _fail(op, f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")
        if block_size not in BLOCK_SIZES or head_size not in HEAD_SIZES:
            raise _fail(op, f"unsupported block_size {block_size} / head_size {head_size}")
        if block_mapping.shape[0] == 0:
            return
        self._check_values(op, "block_mapping", (block_mapping,), (num_blocks,),
                           lambda: checks.block_mapping_violation(block_mapping, num_blocks))
        block_bytes = block_size * kv_heads * head_size * kv_cache.element_size()
        mod = self.backend.module(kv_cache.dtype, head_size, block_size)
        b = self.backend
        with b.launch_context(kv_cache.device):
            mod.get_function("copy_blocks")(
                (block_mapping.shape[0], num_layers * 2), (COPY_THREADS,),
                (b.arg(kv_cache), b.arg(block_mapping), np.int64(block_bytes // 16),
                 np.int64(num_blocks)),
            )

    def _check_decode(self, op: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, float]:
        """A decode's inputs against the contract (a ``_fail`` naming ``op`` otherwise); returns
        the layer's window and soft cap as the kernel takes them."""
        device = query.device
        self._check_pool(op, k_cache, v_cache, device)
        num_seqs, num_heads, head_size = query.shape
        _, block_size, kv_heads, cache_head = k_cache.shape
        if k_cache.dtype != query.dtype:
            raise _fail(op, f"query dtype {query.dtype} differs from the cache dtype {k_cache.dtype}")
        if cache_head != head_size:
            raise _fail(op, f"query head_size {head_size} differs from the cache's {cache_head}")
        if num_heads % kv_heads:
            raise _fail(op, f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_heads}")
        self._check_tensor(op, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,),
                           device=device)
        self._check_tensor(op, "context_lens", context_lens, ndim=1, dtypes=(torch.int32,),
                           device=device)
        if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
            raise _fail(op, f"query has {num_seqs} sequences but block_tables has "
                            f"{block_tables.shape[0]} rows and context_lens {context_lens.shape[0]}")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise _fail(op, f"scale must be a finite float, got {scale!r}")
        window, cap = _layer_options(op, sliding_window, logits_soft_cap)
        num_blocks = k_cache.shape[0]
        self._check_values(op, "decode", (block_tables, context_lens), (num_blocks, block_size),
                           lambda: checks.context_violation(block_tables, context_lens, num_blocks,
                                                            block_size))
        return window, cap

    def _launch_decode(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int,
                       cap: float) -> None:
        """The decode kernel over checked inputs (at least one sequence), then the reduction of
        its partitions where a context may span more than one."""
        device = query.device
        num_seqs, num_heads, head_size = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        max_blocks = block_tables.shape[1]
        max_parts = num_partitions(max_blocks * block_size)
        partition = PARTITION_SIZE if max_parts > 1 else _SINGLE_PASS
        if max_parts > 1:
            part_out = torch.empty(num_seqs, num_heads, max_parts, head_size, dtype=torch.float32,
                                   device=device)
            part_ml = torch.empty(num_seqs, num_heads, max_parts, 2, dtype=torch.float32,
                                  device=device)
        else:  # never written: every sequence has one partition
            part_out = part_ml = torch.empty(1, dtype=torch.float32, device=device)
        group = num_heads // kv_heads
        chunks = -(-group // MAX_GROUP)
        mod = self.backend.module(query.dtype, head_size, block_size)
        b = self.backend
        with b.launch_context(device):
            mod.get_function("paged_decode")(
                (kv_heads * chunks, num_seqs, max_parts), (NUM_THREADS,),
                (b.arg(out), b.arg(part_out), b.arg(part_ml), b.arg(query), b.arg(k_cache),
                 b.arg(v_cache), b.arg(block_tables), b.arg(context_lens), np.float32(scale),
                 np.int32(num_heads), np.int32(kv_heads), np.int32(max_blocks),
                 np.int32(partition), np.int32(max_parts), np.int32(window), np.float32(cap)),
                shared_mem=decode_smem_bytes(head_size, query.element_size()),
            )
            if max_parts > 1:
                mod.get_function("paged_decode_reduce")(
                    (num_heads, num_seqs), (NUM_THREADS,),
                    (b.arg(out), b.arg(part_out), b.arg(part_ml), b.arg(context_lens),
                     np.int32(num_heads), np.int32(partition), np.int32(max_parts),
                     np.int32(window)),
                    shared_mem=reduce_smem_bytes(max_parts),
                )

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
        """See :func:`torch_attention.paged_decode_attention`. ``workspace`` is unused: the kernel
        reads the blocks in place. With a ``sliding_window`` the partitions cover only the keys
        the query sees.

        The launch covers ``ceil(block_tables.shape[1] * block_size / PARTITION_SIZE)``
        partitions, an upper bound known without reading ``context_lens`` back from the device;
        each block past its own sequence's last partition exits at once.
        """
        op = "paged_decode_attention"
        # Any query strides are accepted (attention layers hand over transposed views); the
        # kernel reads a dense copy.
        self._check_tensor(op, "query", query, ndim=3, dtypes=tuple(DTYPE_CODES), device=None,
                           contiguous=False)
        query = query.contiguous()
        window, cap = self._check_decode(op, query, k_cache, v_cache, block_tables, context_lens, scale,
                                         sliding_window, logits_soft_cap)
        out = torch.empty_like(query)
        if query.shape[0]:
            self._launch_decode(out, query, k_cache, v_cache, block_tables, context_lens, scale, window, cap)
        return out

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
        """See :func:`torch_attention.paged_prefill_attention`, which computes it: prefill is
        compute-bound, and SDPA over the gathered blocks is the documented choice. The indices
        are checked first, as for decode (a bad block id in torch's gather is a device-side
        assert, which ends the CUDA context)."""
        op = "paged_prefill_attention"
        if self.check_indices and block_tables.dim() == 2 and k_cache.dim() == 4:
            num_blocks, block_size = k_cache.shape[:2]
            num_tokens = query.shape[0]
            self._check_values(
                op, "prefill", (block_tables, query_start_loc, context_lens),
                (num_blocks, block_size, num_tokens),
                lambda: checks.query_violation(query_start_loc, context_lens, num_tokens)
                or checks.context_violation(block_tables, context_lens, num_blocks, block_size))
        _layer_options(op, sliding_window, logits_soft_cap)
        return torch_attention.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                                 query_start_loc, context_lens, scale, workspace,
                                                 sliding_window, logits_soft_cap)


def _layer_options(op: str, sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, float]:
    """The kernels' ``window`` and ``softcap`` arguments (0: off), checked."""
    window = int(sliding_window or 0)
    cap = float(logits_soft_cap or 0.0)
    if not 0 <= window < 2**31:
        raise _fail(op, f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if not (math.isfinite(cap) and cap >= 0.0):
        raise _fail(op, f"logits_soft_cap must be None or a positive float, got {logits_soft_cap!r}")
    return window, cap


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage starts at ``t``'s first element, for passing strided rows.

    The kernel indexes rows with an explicit stride, so only the base address matters; a
    contiguous tensor passes through unchanged.
    """
    if t.is_contiguous():
        return t
    # as_strided keeps the storage offset; viewing the rows' span as dense is not needed by
    # the kernel, which reads row i at base + i * stride.
    span = (t.shape[0] - 1) * t.stride(0) + t.shape[1] * t.shape[2]
    return t.as_strided((span,), (1,))


_ops: dict[bool, KernelOps] = {}


def get_cuda_ops(check_indices: bool = True) -> KernelOps:
    """The process-wide CUDA ops (compiles lazily, per variant, on first use); both settings
    of ``check_indices`` share one :class:`CupyBackend` and so its compiled modules."""
    if check_indices not in _ops:
        backend = next(iter(_ops.values())).backend if _ops else CupyBackend()
        _ops[check_indices] = KernelOps(backend, check_indices=check_indices)
    return _ops[check_indices]
