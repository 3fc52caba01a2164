"""Top-k, top-p and min-p over a batch of logits rows, and the beam search's top candidates.

Top-k / top-p look at each row's best 256 logits first and sort the whole vocabulary only for
rows whose kept set may reach further.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_filters", "top_candidates"]


#: Candidates examined before a full sort in :func:`apply_filters`; enough for the usual
#: top-k values and for top-p on a peaked distribution.
_FAST_FILTER_WIDTH = 256


def apply_filters(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                  min_p: Sequence[float]) -> torch.Tensor:
    """Mask ``logits`` ([rows, vocab], float32) to ``-inf`` outside each row's top-k, then
    top-p, then min-p set, and return the result (a new tensor).

    * top-k (``0`` / ``-1`` / ``>= vocab``: off) keeps the tokens whose logit is at least the
      k-th largest (ties with it are kept, as HF does);
    * top-p (``1``: off) keeps, over the top-k-renormalised distribution, each token whose
      strictly better tokens hold less than ``top_p`` of the mass (the best token always stays);
    * min-p (``0``: off) drops tokens whose probability is below ``min_p`` times the largest.

    Top-k / top-p first look at the best :data:`_FAST_FILTER_WIDTH` logits of each row (a
    ``topk``, far cheaper than sorting the vocabulary); a row whose kept set may reach beyond
    them is redone with a full sort, so the result is the same either way.
    """
    rows, vocab = logits.shape
    device = logits.device
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    out = logits
    kp = [r for r in range(rows) if ks[r] < vocab or top_p[r] < 1.0]
    if kp:
        out = logits.clone()
        kp_t = torch.tensor(kp, device=device)
        k_t = torch.tensor([ks[r] for r in kp], device=device)
        # top-p thresholds; +inf switches it off for rows with top_p == 1 (float sums may
        # exceed 1 and would otherwise drop tail tokens).
        p_t = torch.tensor([top_p[r] if top_p[r] < 1.0 else torch.inf for r in kp],
                           device=device)[:, None]
        width = min(vocab, max(_FAST_FILTER_WIDTH, max(ks[r] for r in kp if ks[r] < vocab)
                               if any(ks[r] < vocab for r in kp) else 0))
        sub = logits[kp_t]
        if width < vocab:
            vals, order = torch.topk(sub, width, dim=-1)
            # Normaliser of the top-k-renormalised distribution: the kept top-k logits, or the
            # whole row when top-k is off.
            full_lse = torch.logsumexp(sub, dim=-1, keepdim=True)
        else:
            vals, order = torch.sort(sub, dim=-1, descending=True)
            full_lse = None
        kept, complete = _mask_sorted(vals, k_t, p_t, full_lse, vocab)
        new_rows = torch.full_like(sub, -torch.inf).scatter_(1, order, kept)
        if not bool(complete.all()):
            # Rows whose kept set may extend past `width`: redo them exactly with a full sort.
            redo = (~complete).nonzero().flatten()
            vals_f, order_f = torch.sort(sub[redo], dim=-1, descending=True)
            kept_f, _ = _mask_sorted(vals_f, k_t[redo], p_t[redo], None, vocab)
            new_rows[redo] = torch.full_like(vals_f, -torch.inf).scatter_(1, order_f, kept_f)
        out[kp_t] = new_rows

    mp = [r for r in range(rows) if min_p[r] > 0.0]
    if mp:
        if out is logits:
            out = logits.clone()
        mp_t = torch.tensor(mp, device=device)
        sub = out[mp_t]
        probs = torch.softmax(sub, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(
            [min_p[r] for r in mp], device=device)[:, None]
        out[mp_t] = sub.masked_fill(probs < threshold, -torch.inf)
    return out


def _mask_sorted(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                 full_lse: torch.Tensor | None, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k and top-p to each row's best logits ``vals`` (sorted descending).

    ``vals`` holds the first ``width`` entries of rows of ``vocab`` logits; when ``width <
    vocab``, ``full_lse`` is the logsumexp of each whole row. ``k == vocab`` means top-k is off.
    Returns the masked values and, per row, whether the answer is certain from these entries
    alone (always True when ``width == vocab``).
    """
    width = vals.shape[1]
    is_full = width == vocab
    rows = torch.arange(vals.shape[0], device=vals.device)
    k_in = k.clamp(max=width)
    kth = vals[rows, k_in - 1][:, None]
    topk_on = k < vocab
    masked = torch.where(topk_on[:, None] & (vals < kth), -torch.inf, vals)
    # The renormalised distribution over the kept top-k set (or the whole row).
    if is_full:
        lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    else:
        assert full_lse is not None
        lse = torch.where(topk_on[:, None], torch.logsumexp(masked, dim=-1, keepdim=True),
                          full_lse)
    probs = torch.exp(masked - lse)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    masked = masked.masked_fill(mass_before >= top_p, -torch.inf)
    if is_full:
        return masked, torch.ones(vals.shape[0], dtype=torch.bool, device=vals.device)
    # Certain when every token past `width` is dropped. With top-k on: when the last window
    # logit is strictly below the k-th, so that no tie spills over (the top-k set, and so the
    # top-p normaliser, lies inside the window). With top-k off: when the window already holds
    # top_p of the mass (the normaliser is the whole row's).
    by_k = vals[:, -1] < kth.squeeze(1)
    by_p = probs.sum(dim=-1) >= top_p.squeeze(1)
    return masked, torch.where(topk_on, by_k, by_p)


def top_candidates(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's ``k`` best next tokens as ``(token_id, logprob)``, best first, with logprobs
    from ``log_softmax`` of the float32 logits, exactly as HF's beam search computes them; this
    is the ``candidates`` argument of :meth:`batchgen.sampling.beam_ranking.BeamSearchState.step`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
