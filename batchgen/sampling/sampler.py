"""The batched sampler: one call turns a step's last-token logits into one token per row.

Per row, in this order (vLLM's and HF's order):

1. ``suppress_token_ids`` are set to ``-inf`` (the engine passes EOS / stop ids while fewer than
   ``min_tokens`` tokens have been generated);
2. penalties: repetition (HF semantics over prompt + output tokens: a positive logit is divided
   by the penalty, a negative one multiplied), then frequency and presence (OpenAI semantics
   over output tokens: ``logit -= frequency * count + presence * (count > 0)``);
3. temperature (rows with temperature 0 skip it: argmax does not depend on scale);
4. the row's logits processors, on float32 logits;
5. top-k (ties with the k-th logit are kept), top-p (the smallest set of best tokens whose
   probability reaches ``top_p``), min-p (tokens below ``min_p * max_prob`` are dropped);
6. the choice: greedy rows (``params.is_greedy``: temperature 0 or top-k 1) take
   ``torch.argmax`` (first index on ties, as HF); sampled rows draw from the softmax of the
   filtered logits by an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d.,
   which is an exact categorical draw. A row with a ``generator`` draws its ``vocab`` values of
   ``q`` from that generator alone, so a seeded row gets the same token whatever other rows
   share the batch; rows without one share a single draw from the global RNG.

Reported logprobs are log-softmax of the RAW logits (before penalties, temperature, processors
and filters), as vLLM reports them by default: they describe the model, not the sampling
distribution. ``top_logprobs`` holds, for rows whose ``params.logprobs`` is set, the chosen
token and the ``params.logprobs`` most likely tokens.

Work is vectorised over rows: an all-greedy batch without penalties is one argmax and one
logsumexp; Python loops run only per seeded row (its own generator) and per group of rows
that share a logits-processor list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.sampling.params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "top_candidates"]


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits.

    ``generator`` is the sequence's own ``torch.Generator`` (seeded by the engine, on the
    logits' device), or None to use the global RNG. ``suppress_token_ids`` are masked to
    ``-inf`` before anything else.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    suppress_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """One entry per row, in row order.

    ``logprobs[i]`` is the raw-logit log-softmax of the chosen token. ``top_logprobs[i]`` is
    None unless the row asked for logprobs; then it maps token id -> logprob for the chosen
    token and the ``params.logprobs`` best tokens (so it has ``logprobs`` or ``logprobs + 1``
    entries).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def _padded_ids(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Stack ragged id lists into a [rows, max_len] long tensor padded with ``pad``."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out.to(device)


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list (ids must be < vocab)."""
    ids = _padded_ids(seqs, vocab, device)  # pad with an extra column, dropped below
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


class Sampler:
    """Stateless batched sampler; see the module docstring for the exact semantics."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Choose one token per row of ``logits`` ([len(rows), vocab], any float dtype).

        Computation is in float32. ``logits`` itself is never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return SamplerOutput([], [], [])
        device = logits.device
        raw = logits.float()
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]

        modifies = not all(greedy) or any(
            r.suppress_token_ids or r.params.has_penalties or r.params.logits_processors
            or r.params.temperature not in (0.0, 1.0) for r in rows)
        # The working copy that penalties, temperature and filters act on; `raw` and the
        # caller's `logits` stay untouched (an all-greedy plain batch needs no copy).
        x = raw.clone() if modifies else raw
        self._suppress(x, rows)
        self._apply_penalties(x, rows)
        self._apply_temperature(x, params)
        self._apply_processors(x, rows)
        sampled_idx = [i for i, g in enumerate(greedy) if not g]
        if sampled_idx:
            self._apply_filters(x, params, sampled_idx)

        dead = torch.isneginf(x.amax(dim=-1))
        if bool(dead.any()):
            bad = dead.nonzero().flatten().tolist()
            raise ValueError(
                f"rows {bad} have every token masked to -inf (suppress ids, logits processors "
                "or filters removed the whole vocabulary); nothing can be sampled")

        chosen = torch.argmax(x, dim=-1)  # greedy rows keep this: ties -> first index
        if sampled_idx:
            chosen[sampled_idx] = self._sample(x, rows, sampled_idx)

        # Reported logprobs: log-softmax of the raw logits, as raw - logsumexp(raw), one
        # formula for the chosen token and the alternatives so that both agree exactly.
        lse = torch.logsumexp(raw, dim=-1)
        chosen_lp = raw.gather(1, chosen[:, None]).squeeze(1) - lse
        token_ids = chosen.tolist()
        logprobs = chosen_lp.tolist()
        top: list[dict[int, float] | None] = [None] * num_rows
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k_max = min(max(params[i].logprobs or 0 for i in want), vocab)
            if k_max > 0:
                want_t = torch.tensor(want, device=device)
                values, indices = torch.topk(raw[want_t], k_max, dim=-1)
                values = (values - lse[want_t, None]).tolist()
                indices = indices.tolist()
            for j, i in enumerate(want):
                k = min(params[i].logprobs or 0, vocab)
                entry = {token_ids[i]: logprobs[i]}
                if k > 0:
                    for t, v in zip(indices[j][:k], values[j][:k]):
                        entry.setdefault(t, v)
                top[i] = entry
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    # ------------------------------------------------------------------------ stages
    @staticmethod
    def _suppress(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Set every row's ``suppress_token_ids`` to -inf, in one indexed write."""
        r_idx: list[int] = []
        t_idx: list[int] = []
        for i, row in enumerate(rows):
            if row.suppress_token_ids:
                ids = list(row.suppress_token_ids)
                r_idx.extend([i] * len(ids))
                t_idx.extend(ids)
        if r_idx:
            x[torch.tensor(r_idx, device=x.device), torch.tensor(t_idx, device=x.device)] = -torch.inf

    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Repetition, then frequency and presence penalties, over the rows that use them."""
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return
        device, vocab = x.device, x.shape[1]
        idx_t = torch.tensor(idx, device=device)
        sub = x[idx_t]
        ps = [rows[i].params for i in idx]
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = _token_counts([list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids)
                                  for i in idx], vocab, device) > 0
            rep = torch.tensor([p.repetition_penalty for p in ps], device=device)[:, None]
            # HF's RepetitionPenaltyLogitsProcessor, verbatim in semantics.
            penalised = torch.where(sub < 0, sub * rep, sub / rep)
            sub = torch.where(seen, penalised, sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps):
            counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, device)
            freq = torch.tensor([p.frequency_penalty for p in ps], device=device)[:, None]
            pres = torch.tensor([p.presence_penalty for p in ps], device=device)[:, None]
            sub = sub - freq * counts - pres * (counts > 0).float()
        x[idx_t] = sub

    @staticmethod
    def _apply_temperature(x: torch.Tensor, params: list[SamplingParams]) -> None:
        """Divide each row by its temperature; temperature-0 rows are left alone (their argmax
        does not depend on scale). A top-k-1 row with a temperature is divided too, so that
        its logits processors see the same logits as they would when sampling."""
        temps = [p.temperature if p.temperature > 0.0 else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, device=x.device, dtype=x.dtype)[:, None])

    @staticmethod
    def _apply_processors(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Run logits processors; rows that share one processor list (e.g. the n samples of a
        request) are processed together in one call per processor."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, row in enumerate(rows):
            procs = row.params.logits_processors
            if procs:
                groups.setdefault(tuple(id(p) for p in procs), []).append(i)
        for idx in groups.values():
            idx_t = torch.tensor(idx, device=x.device)
            sub = x[idx_t]
            outputs = [list(rows[i].output_token_ids) for i in idx]
            for proc in rows[idx[0]].params.logits_processors:
                result = proc(sub, outputs)
                if not isinstance(result, torch.Tensor) or result.shape != sub.shape:
                    raise ValueError(
                        f"logits processor {proc!r} must return a tensor of shape "
                        f"{tuple(sub.shape)}, got "
                        f"{tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__}")
                sub = result.to(dtype=torch.float32)
            x[idx_t] = sub

    @staticmethod
    def _apply_filters(x: torch.Tensor, params: list[SamplingParams],
                       sampled_idx: list[int]) -> None:
        """Top-k, top-p then min-p on the sampled rows that use them, vectorised."""
        vocab = x.shape[1]
        device = x.device

        def top_k_of(p: SamplingParams) -> int:
            return p.top_k if 0 < p.top_k < vocab else vocab  # 0 / -1 / >= vocab: off

        kp_idx = [i for i in sampled_idx if top_k_of(params[i]) < vocab or params[i].top_p < 1.0]
        if kp_idx:
            idx_t = torch.tensor(kp_idx, device=device)
            sub = x[idx_t]
            ks = torch.tensor([top_k_of(params[i]) for i in kp_idx], device=device)
            if all(params[i].top_p >= 1.0 for i in kp_idx):
                # top-k only: the k-th largest logit via topk, cheaper than a full sort.
                top_vals = torch.topk(sub, int(ks.max()), dim=-1).values
                kth = top_vals.gather(1, (ks - 1)[:, None])
                sub = sub.masked_fill(sub < kth, -torch.inf)  # ties with the k-th are kept
            else:
                vals, order = torch.sort(sub, dim=-1, descending=True)
                kth = vals.gather(1, (ks - 1)[:, None])
                vals = vals.masked_fill(vals < kth, -torch.inf)
                # top-p over the top-k-renormalised distribution: drop a token when the mass
                # of the strictly better tokens already reaches top_p (the best is always kept).
                top_p = torch.tensor(
                    [params[i].top_p if params[i].top_p < 1.0 else torch.inf for i in kp_idx],
                    device=device)[:, None]
                probs = torch.softmax(vals, dim=-1)
                mass_before = torch.cumsum(probs, dim=-1) - probs
                vals = vals.masked_fill(mass_before >= top_p, -torch.inf)
                sub = torch.empty_like(sub).scatter_(1, order, vals)
            x[idx_t] = sub

        mp_idx = [i for i in sampled_idx if params[i].min_p > 0.0]
        if mp_idx:
            idx_t = torch.tensor(mp_idx, device=device)
            sub = x[idx_t]
            probs = torch.softmax(sub, dim=-1)
            min_p = torch.tensor([params[i].min_p for i in mp_idx], device=device)[:, None]
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            x[idx_t] = sub.masked_fill(probs < threshold, -torch.inf)

    @staticmethod
    def _sample(x: torch.Tensor, rows: list[SamplingRow], sampled_idx: list[int]) -> torch.Tensor:
        """Exponential race over the sampled rows; returns their chosen token ids."""
        device = x.device
        probs = torch.softmax(x[torch.tensor(sampled_idx, device=device)], dim=-1)
        q = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled_idx) if rows[i].generator is None]
        if unseeded:
            q[torch.tensor(unseeded, device=device)] = torch.empty(
                (len(unseeded), probs.shape[1]), device=device).exponential_()
        for j, i in enumerate(sampled_idx):
            gen = rows[i].generator
            if gen is not None:
                # Exactly `vocab` draws from this row's generator, whatever the batch holds.
                q[j].exponential_(generator=gen)
        # q can be 0 in float32; 0/0 would be NaN, which argmax would pick. A tiny floor keeps
        # masked tokens (prob 0) at 0 and changes nothing else measurably.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return torch.argmax(probs / q, dim=-1)


def top_candidates(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's ``k`` best next tokens as ``(token_id, logprob)``, best first, with logprobs
    from ``log_softmax`` of the float32 logits, exactly as HF's beam search computes them; this
    is the ``candidates`` argument of :meth:`batchgen.sampling.beam.BeamSearchState.step`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
