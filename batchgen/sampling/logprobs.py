"""Token logprobs from hidden states, reduced chunk by chunk (prompt logprobs, scoring).

Scoring a prompt needs, at each scored position, the logprob of the next prompt token, its
rank and the top k alternatives: a handful of numbers per position. The full distribution is
``vocab`` floats per position, so a whole prompt's logits (``[prompt length x vocab]`` float32)
would dwarf the model on long prompts. :func:`reduce_logprobs` never builds it: it takes the
final hidden states of the scored positions, runs the output layer over at most ``chunk_rows``
of them at a time, and keeps only the reduced numbers. Peak memory is one chunk of logits,
whatever the number of positions.

Per position, with ``logits`` the float32 output of the model (after any final scaling the
model applies) and ``lse`` their logsumexp:

* ``logprob = logits[target] - lse`` (log-softmax of the raw logits, as vLLM reports prompt
  logprobs and as lm-eval's ``hf`` model gathers them);
* ``rank = 1 + #{v : logits[v] > logits[target]}`` (vLLM's rank: 1 is the most likely token;
  tokens tied with the target share its rank);
* the ``num_top`` best tokens and their logprobs, best first (``torch.topk``).

On the CPU (``fused``) the logsumexp and rank come from one C pass pair per row
(:func:`batchgen.kernels.cpu.fused.token_logprobs`: the sampler's logsumexp, summed in double)
instead of torch's five passes (compare, max, subtract-exp, sum) over the chunk: for one
2048-token window of SmolLM2 (2048 rows x 49152) about 0.2 s of torch ops become about 0.04 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels.cpu import fused as cpu_fused

__all__ = ["TokenLogprobs", "reduce_logprobs", "chunk_rows_for"]

#: Logits elements held at once by :func:`reduce_logprobs` by default (16 MiB of float32).
DEFAULT_CHUNK_ELEMENTS = 1 << 22


#: The quantized GEMM's row block (``MC`` in ``kernels/cpu/quant.c``): a chunk of logits rows
#: that fills whole blocks leaves no short block to stream the lm-head's panels again for.
ROW_BLOCK = 64


def chunk_rows_for(vocab_size: int, max_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Positions per chunk so that one chunk of logits holds at most ``max_elements`` floats,
    rounded down to whole :data:`ROW_BLOCK` rows where it holds more than one.

    SmolLM2's 49,152-token vocabulary gets 64 rows instead of 85: the Q8_0 lm-head ran 85 rows as
    a block of 64 and one of 21 (on two panels at once past 64 rows), 495 GOP/s against 575 for
    64 rows in the same process (Zen 4, 2 threads). The rows' numbers do not depend on the chunk.
    """
    rows = max(1, max_elements // max(1, vocab_size))
    return rows // ROW_BLOCK * ROW_BLOCK if rows >= ROW_BLOCK else rows


@dataclass
class TokenLogprobs:
    """The reduced numbers of ``n`` scored positions, in input order (plain Python lists).

    ``top_ids[i]`` / ``top_logprobs[i]`` hold ``num_top`` entries, best first (empty lists when
    ``num_top`` is 0).
    """

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprobs)


def reduce_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    num_top: int = 0,
    chunk_rows: int = 64,
    fused: bool = False,
) -> TokenLogprobs:
    """Reduce ``compute_logits(hidden)`` to each row's target logprob, rank and top ``num_top``.

    Args:
        hidden: ``[n, hidden_size]`` final hidden states of the scored positions.
        targets: ``[n]`` token ids whose logprob each row reports.
        compute_logits: the model's output layer: ``[m, hidden_size] -> [m, vocab]`` logits, a
            fresh tensor (the reduction overwrites it).
        num_top: alternatives reported per row besides the target (0: none).
        chunk_rows: rows sent through ``compute_logits`` at once (>= 1); the caller sizes
            it with :func:`chunk_rows_for` from the vocabulary.
        fused: take each row's logsumexp and rank from the fused CPU pass
            (:func:`batchgen.kernels.cpu.fused.token_logprobs`, the sampler's logsumexp) where
            it runs (float32 CPU logits, finite rows); torch's ops otherwise. Either way a row's
            numbers depend on that row alone, not on ``num_top`` nor on the other rows.
    """
    n = hidden.shape[0]
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape [{n}], got {tuple(targets.shape)}")
    out = TokenLogprobs([], [], [], [])
    start = 0
    while start < n:
        logits = compute_logits(hidden[start:start + chunk_rows]).float()
        rows = logits.shape[0]
        tgt = targets[start:start + rows].to(logits.device)
        target_logits = logits.gather(1, tgt.unsqueeze(1)).squeeze(1)
        if num_top > 0:
            values, ids = torch.topk(logits, min(num_top, logits.shape[-1]), dim=-1)
        lse, ranks = _lse_and_ranks(logits, tgt, target_logits, fused)
        del logits
        out.logprobs.extend((target_logits - lse).tolist())
        out.ranks.extend(ranks.tolist())
        if num_top > 0:
            out.top_ids.extend(ids.tolist())
            out.top_logprobs.extend((values - lse.unsqueeze(1)).tolist())
        else:
            out.top_ids.extend([] for _ in range(rows))
            out.top_logprobs.extend([] for _ in range(rows))
        start += rows
    return out


def _lse_and_ranks(logits: torch.Tensor, tgt: torch.Tensor, target_logits: torch.Tensor,
                   fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logsumexp and its target's rank (``1 + #{v : logits[v] > target}``): from the
    fused CPU pass when ``fused`` and it runs, with torch's ops for the rows it leaves (NaN or
    infinities); torch's alone otherwise. May overwrite ``logits``."""
    result = cpu_fused.token_logprobs(logits, tgt) if fused else None
    if result is not None:
        lse, ranks = result
        bad = ~torch.isfinite(lse)
        if bool(bad.any()):
            lse[bad] = torch.logsumexp(logits[bad], dim=-1)
        return lse, ranks
    ranks = (logits > target_logits.unsqueeze(1)).sum(dim=-1) + 1
    # logsumexp in place (the chunk is ours): no second chunk-sized buffer
    peak = logits.amax(dim=-1, keepdim=True)
    lse = (peak + logits.sub_(peak).exp_().sum(dim=-1, keepdim=True).log_()).squeeze(1)
    return lse, ranks
