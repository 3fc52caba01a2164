"""Value checks of the indices the CUDA kernels follow: context lengths, block ids and slots.

The kernels read and write raw memory through ``block_tables``, ``slot_mapping`` and
``block_mapping`` and stop at ``context_lens``; a wrong value there is an out-of-bounds access
on the GPU, which either corrupts memory silently or kills the CUDA context. Shape and dtype
checks (in :class:`~batchgen.kernels.cuda.cuda_attention.KernelOps`) cannot see values, so these
functions look at them, with the same rules as the CPU kernel's first pass:

* ``1 <= context_lens[s] <= block_tables.shape[1] * block_size``;
* every block-table entry a sequence reads (its first ``ceil(context_len / block_size)``) in
  ``[0, num_blocks)``; padding past them is never read and may hold anything;
* ``slot_mapping`` entries below ``num_blocks * block_size`` (negative ones mark padding and
  are skipped);
* ``block_mapping`` entries in ``[0, num_blocks)``;
* for prefill, ``query_start_loc`` rising from 0 to the number of query tokens, no sequence's
  query longer than its context.

Each function runs a few torch ops on the tensors' own device and reads back one boolean (one
host sync; nothing is copied to the host unless something is wrong, and then only to name the
first offender). It returns None when the values are valid, else a message naming the argument,
the first bad element and the rule. Tensors on the CPU work the same way (the tests use that).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True element of ``mask`` (row-major)."""
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def _blocks_read(context_lens: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """``[num_seqs, width]`` mask of the table entries each sequence reads."""
    needed = (context_lens.to(torch.int64) + block_size - 1).div(block_size, rounding_mode="floor")
    cols = torch.arange(width, device=context_lens.device)
    return cols[None, :] < needed[:, None]


def context_violation(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                      block_size: int) -> str | None:
    """Why ``context_lens`` / ``block_tables`` would send a kernel out of bounds, or None.

    Args:
        block_tables: ``[num_seqs, width]`` int, physical block ids.
        context_lens: ``[num_seqs]`` int, tokens each sequence attends to.
        num_blocks: blocks in the pool (``k_cache.shape[0]``).
        block_size: tokens per block.
    """
    num_seqs, width = block_tables.shape
    if num_seqs == 0:
        return None
    limit = width * block_size
    lens = context_lens.to(torch.int64)
    bad_len = (lens < 1) | (lens > limit)
    read = _blocks_read(lens.clamp(0, limit), block_size, width)
    bad_entry = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if not bool(bad_len.any() | bad_entry.any()):  # the one sync of a valid call
        return None
    if bool(bad_len.any()):
        (s,) = _first(bad_len)
        return (f"context_lens must be in [1, {limit}] (block_tables' width {width} x block_size "
                f"{block_size}); context_lens[{s}] = {int(lens[s])}")
    s, b = _first(bad_entry)
    return (f"block table entries a sequence reads must be in [0, {num_blocks}) (the pool's "
            f"blocks); block_tables[{s}, {b}] = {int(block_tables[s, b])} (context_lens[{s}] = "
            f"{int(lens[s])})")


def query_violation(query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                    num_tokens: int) -> str | None:
    """Why ``query_start_loc`` does not describe ``num_tokens`` packed query rows, or None.

    It must rise from 0 to ``num_tokens``, and no sequence's query may be longer than its
    context (its query rows are its last tokens).
    """
    starts = query_start_loc.to(torch.int64)
    if starts.numel() != context_lens.numel() + 1:
        return (f"query_start_loc must have num_seqs + 1 = {context_lens.numel() + 1} entries, "
                f"got {starts.numel()}")
    q_lens = starts[1:] - starts[:-1]
    bad = (q_lens < 0) | (q_lens > context_lens.to(torch.int64))
    ends_ok = (starts[0] == 0) & (starts[-1] == num_tokens)
    if not bool(bad.any() | ~ends_ok):
        return None
    if not bool(ends_ok):
        return (f"query_start_loc must start at 0 and end at the {num_tokens} query tokens; got "
                f"{int(starts[0])} .. {int(starts[-1])}")
    (s,) = _first(bad)
    return (f"query_start_loc must rise, each sequence's query no longer than its context; "
            f"sequence {s} has {int(q_lens[s])} query tokens and context_lens[{s}] = "
            f"{int(context_lens[s])}")


def slot_violation(slot_mapping: torch.Tensor, num_slots: int) -> str | None:
    """Why ``slot_mapping`` would write outside a pool of ``num_slots`` slots, or None.

    Negative slots are padding (skipped by the kernel) and allowed.
    """
    if slot_mapping.numel() == 0:
        return None
    bad = slot_mapping >= num_slots
    if not bool(bad.any()):
        return None
    (i,) = _first(bad)
    return (f"slot_mapping entries must be below {num_slots} (num_blocks x block_size; negative "
            f"= padding); slot_mapping[{i}] = {int(slot_mapping[i])}")


def block_mapping_violation(block_mapping: torch.Tensor, num_blocks: int) -> str | None:
    """Why a ``[num_pairs, 2]`` (src, dst) ``block_mapping`` leaves the pool, or None."""
    if block_mapping.numel() == 0:
        return None
    bad = (block_mapping < 0) | (block_mapping >= num_blocks)
    if not bool(bad.any()):
        return None
    i, j = _first(bad)
    return (f"block_mapping entries must be in [0, {num_blocks}) (the pool's blocks); "
            f"block_mapping[{i}, {j}] = {int(block_mapping[i, j])}")


class CheckedOnce:
    """Remembers which tensors passed a check, so a step's layers check its tables once.

    The engine builds new index tensors every step and hands the same objects to every layer;
    a value check is a host sync, so it runs on the first layer only. A result is reused only
    for the very same tensor objects (held by weak reference, so a freed tensor whose address
    is reused is not mistaken for it), with the same other arguments, and, for tensors that
    track in-place changes (everything but inference-mode tensors), the same version counter.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], tuple[int | None, ...]]] = {}

    @staticmethod
    def _versions(tensors: Sequence[torch.Tensor]) -> tuple[int | None, ...]:
        return tuple(None if t.is_inference() else t._version for t in tensors)

    def seen(self, name: str, tensors: Sequence[torch.Tensor], extra: tuple[Any, ...]) -> bool:
        """Whether ``tensors`` (with ``extra``) are the ones last remembered under ``name``."""
        entry = self._last.get(name)
        if entry is None:
            return False
        refs, last_extra, versions = entry
        return (last_extra == extra and len(refs) == len(tensors)
                and all(r() is t for r, t in zip(refs, tensors))
                and versions == self._versions(tensors))

    def remember(self, name: str, tensors: Sequence[torch.Tensor], extra: tuple[Any, ...]) -> None:
        self._last[name] = (tuple(weakref.ref(t) for t in tensors), extra, self._versions(tensors))
