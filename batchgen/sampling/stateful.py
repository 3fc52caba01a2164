"""Applying stateful logits processors to a batch: one shared token bitmask per step.

:func:`apply_stateful` is used by the sampler (sampled and greedy rows) and by the beam step
(on each beam's log-softmax scores); the contract the processors follow is
:class:`batchgen.sampling.processors.StatefulLogitsProcessor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["apply_stateful", "unpack_bitmask"]


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, ceil(vocab / 32)]`` int32 bitmask -> ``[rows, vocab]`` bool, True = allowed
    (bit ``b`` of word ``w`` is token ``32 * w + b``: xgrammar's and vLLM's layout)."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_stateful(x: torch.Tensor, processors: Sequence[Sequence[Any]],
                   states: Sequence[Sequence[Any]]) -> None:
    """Apply the stateful logits processors to ``x`` ([rows, vocab] float32), in place.

    ``processors[i]`` are row ``i``'s :class:`batchgen.plugins.StatefulLogitsProcessor` objects
    and ``states[i]`` its state of each. Masking processors go first: every row that one
    constrains gets a row of one shared int32 bitmask (all bits set), each processor fills the
    rows of all its states in one ``fill_mask`` call, and the mask is applied to the logits of
    all those rows in one ``masked_fill`` (a row with two masking processors gets a second
    layer of bitmask, ANDed the same way). Then each row-editing processor gets one
    ``process`` call over all its rows. Rows without processors are not touched.
    """
    layers: list[dict[int, tuple[Any, list[int], list[Any]]]] = []
    edits: dict[int, tuple[Any, list[int], list[Any]]] = {}
    for i, (procs, sts) in enumerate(zip(processors, states)):
        depth = 0
        for proc, state in zip(procs, sts):
            if proc.masks:
                if depth == len(layers):
                    layers.append({})
                entry = layers[depth].setdefault(id(proc), (proc, [], []))
                entry[1].append(i)
                entry[2].append(state)
                depth += 1
            if proc.edits:
                entry = edits.setdefault(id(proc), (proc, [], []))
                entry[1].append(i)
                entry[2].append(state)
    vocab = x.shape[1]
    for layer in layers:
        rows = sorted({i for _, idx, _ in layer.values() for i in idx})
        where = {r: j for j, r in enumerate(rows)}
        bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
        for proc, idx, sts in layer.values():
            proc.fill_mask(sts, bitmask, [where[i] for i in idx])
        forbidden = ~unpack_bitmask(bitmask.to(x.device), vocab)
        if len(rows) == x.shape[0]:  # every row constrained: no gather / scatter
            x.masked_fill_(forbidden, -torch.inf)
        else:
            rows_t = torch.tensor(rows, device=x.device)
            x[rows_t] = x[rows_t].masked_fill_(forbidden, -torch.inf)
    for proc, idx, sts in edits.values():
        idx_t = torch.tensor(idx, device=x.device)
        sub = x[idx_t]
        result = proc.process(sub, sts)
        if not isinstance(result, torch.Tensor) or result.shape != sub.shape:
            raise ValueError(
                f"stateful logits processor {proc!r} must return a tensor of shape "
                f"{tuple(sub.shape)}, got "
                f"{tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__}")
        x[idx_t] = result.to(dtype=x.dtype)
