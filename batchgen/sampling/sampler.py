"""The batched sampler: one call turns a step's last-token logits into one token per row.

Per row, in this order (vLLM's and HF's order):

1. ``suppress_token_ids`` are set to ``-inf`` (the engine passes EOS / stop ids while fewer than
   ``min_tokens`` tokens have been generated);
2. penalties: repetition (HF semantics over prompt + output tokens: a positive logit is divided
   by the penalty, a negative one multiplied), then frequency and presence (OpenAI semantics
   over output tokens: ``logit -= frequency * count + presence * (count > 0)``);
3. temperature (rows with temperature 0 skip it: argmax does not depend on scale);
4. the row's logits processors, on float32 logits: the stateless ones, then the stateful ones
   (:func:`apply_stateful`: one shared token bitmask filled by the masking processors and
   applied in one op, then the row-editing ones);
5. top-k (ties with the k-th logit are kept), top-p (the smallest set of best tokens whose
   probability reaches ``top_p``), min-p (tokens below ``min_p * max_prob`` are dropped);
6. the choice: greedy rows (``params.is_greedy``: temperature 0 or top-k 1) take
   ``torch.argmax`` (first index on ties, as HF); sampled rows draw from the softmax of the
   filtered logits by inverse CDF with one uniform number per row. A row with a ``generator``
   draws its number from that generator alone, so a seeded row gets the same token whatever
   other rows share the batch; rows without one share a single draw from the global RNG.

Reported logprobs are log-softmax of the RAW logits (before penalties, temperature, processors
and filters), as vLLM reports them by default: they describe the model, not the sampling
distribution. ``top_logprobs`` holds, for rows whose ``params.logprobs`` is set, the chosen
token and the ``params.logprobs`` most likely tokens.

Work is vectorised over rows: an all-greedy batch without penalties is one argmax and one
logsumexp; Python loops run only per seeded row (one draw from its own generator) and per
group of rows that share a logits-processor list. Top-k / top-p look at each row's best 256
logits first and sort the whole vocabulary only for rows whose kept set may reach further.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.sampling.params import SamplingParams, is_stateful
from batchgen.sampling.filters import apply_filters
from batchgen.sampling.processors import describe_processor
from batchgen.sampling.stateful import apply_stateful

__all__ = ["MaskedRowsError", "Sampler", "SamplerOutput", "SamplingRow", "explain_masked"]


class MaskedRowsError(ValueError):
    """Rows of a batch have every token masked to ``-inf``: nothing can be sampled from them.

    ``rows`` are their indices; the other rows of the batch are sound, and sampling them alone
    gives what they would have got in the batch (a row never depends on the others). The engine
    fails only these rows' requests, naming the cause (:func:`explain_masked`).
    """

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        super().__init__(
            f"rows {rows} have every token masked to -inf (suppress ids, logits processors "
            "or filters removed the whole vocabulary); nothing can be sampled")


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits.

    ``generator`` is the sequence's own ``torch.Generator`` (seeded by the engine, on the
    logits' device), or None to use the global RNG. ``suppress_token_ids`` are masked to
    ``-inf`` before anything else. ``processors`` are the row's stateful logits processors and
    ``states`` its state of each (see :func:`apply_stateful`).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    suppress_token_ids: Sequence[int] = ()
    processors: Sequence[Any] = ()
    states: Sequence[Any] = ()


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


def _padded_rows(per_row: list[list[int]], per_row_values: list[list[float]] | None,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack ragged rows of token ids (each non-empty, no repeats) into a [rows, width] long
    tensor, padding a row by repeating its first entry (and value): a scatter of the padded
    row then writes the same value twice to one place, which is harmless and deterministic."""
    width = max(len(r) for r in per_row)
    ids = [r + [r[0]] * (width - len(r)) for r in per_row]
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    if per_row_values is None:
        return ids_t, None
    vals = [v + [v[0]] * (width - len(v)) for v in per_row_values]
    return ids_t, torch.tensor(vals, dtype=torch.float32, device=device)


class Sampler:
    """Stateless batched sampler; see the module docstring for the exact semantics.

    Args:
        fused_greedy: pick an all-greedy plain batch (no penalties, processors or requested
            logprobs) with :func:`batchgen.kernels.cpu.fused.greedy` when the logits are
            float32 on the CPU, and take every row's logsumexp from the same C pass: the same
            tokens and logprobs, bit for bit, whichever path a batch takes. The engine turns it
            on with ``linear_backend="cpu"``.
    """

    def __init__(self, fused_greedy: bool = False) -> None:
        self.fused_greedy = fused_greedy

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Choose one token per row of ``logits`` ([len(rows), vocab], any float dtype).

        Computation is in float32. ``logits`` itself is never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SamplerOutput([], [], [])
        raw = logits.float()
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]

        modifies = not all(greedy) or any(
            r.suppress_token_ids or r.params.has_penalties or r.params.logits_processors
            or r.processors or r.params.temperature not in (0.0, 1.0) for r in rows)
        if self.fused_greedy and not modifies and all(p.logprobs is None for p in params):
            # Nothing below would change the logits: pick in one C pass where it can run.
            fast = cpu_fused.greedy(raw)  # None: not float32 CPU, or NaN/inf in a row
            if fast is not None:
                return SamplerOutput(token_ids=fast[0], logprobs=fast[1], top_logprobs=[None] * num_rows)
        # The working copy that penalties, temperature and filters act on; `raw` and the
        # caller's `logits` stay untouched (an all-greedy plain batch needs no copy).
        x = raw.clone() if modifies else raw
        self._suppress(x, rows)
        self._apply_penalties(x, rows)
        self._apply_temperature(x, params)
        self._apply_processors(x, rows)
        if modifies and any(r.processors for r in rows):
            apply_stateful(x, [r.processors for r in rows], [r.states for r in rows])
        sampled_idx = [i for i, g in enumerate(greedy) if not g]
        if sampled_idx:
            self._apply_filters(x, params, sampled_idx)

        self._check_finite(x)
        if len(sampled_idx) == num_rows:
            chosen = self._sample(x, rows, sampled_idx)
        else:
            chosen = torch.argmax(x, dim=-1)  # greedy rows keep this: ties -> first index
            if sampled_idx:
                chosen[sampled_idx] = self._sample(x, rows, sampled_idx)

        # Reported logprobs: log-softmax of the raw logits, as raw - logsumexp(raw) taken in
        # double, one formula for the chosen token and the alternatives (and the fused greedy
        # pick) so that all agree exactly.
        lse = self._logsumexp(raw)
        chosen_lp = raw.gather(1, chosen[:, None]).squeeze(1).double() - lse
        token_ids = chosen.tolist()
        logprobs = chosen_lp.tolist()
        top = self._top_logprobs(raw, lse, params, token_ids, logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    @staticmethod
    def _check_finite(x: torch.Tensor) -> None:
        """Raise for the rows that cannot be sampled from: all -inf (masked away:
        :class:`MaskedRowsError`), or holding a NaN or a +inf (``ValueError``). One row-wise
        max finds them all (the max propagates both)."""
        top = x.amax(dim=-1)
        broken = ~torch.isfinite(top)
        if bool(broken.any()):
            bad = broken.nonzero().flatten().tolist()
            masked = torch.isneginf(top).nonzero().flatten().tolist()
            if masked and bool(torch.isneginf(top[broken]).all()):
                raise MaskedRowsError(masked)
            what = "NaN" if bool(top[broken].isnan().any()) else "+inf"
            raise ValueError(
                f"rows {bad} hold {what} logits (from the model or a logits processor); "
                "nothing can be sampled from them")

    @staticmethod
    def _top_logprobs(raw: torch.Tensor, lse: torch.Tensor, params: list[SamplingParams],
                      token_ids: list[int], logprobs: list[float]) -> list[dict[int, float] | None]:
        """For each row that asked for logprobs: its chosen token and its ``params.logprobs``
        best tokens, token id -> raw-logit logprob (None for the other rows)."""
        num_rows, vocab = raw.shape
        top: list[dict[int, float] | None] = [None] * num_rows
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k_max = min(max(params[i].logprobs or 0 for i in want), vocab)
            if k_max > 0:
                want_t = torch.tensor(want, device=raw.device)
                values, indices = torch.topk(raw[want_t], k_max, dim=-1)
                values = (values.double() - lse[want_t, None]).tolist()
                indices = indices.tolist()
            for j, i in enumerate(want):
                k = min(params[i].logprobs or 0, vocab)
                entry = {token_ids[i]: logprobs[i]}
                if k > 0:
                    for t, v in zip(indices[j][:k], values[j][:k]):
                        entry.setdefault(t, v)
                top[i] = entry
        return top

    def _logsumexp(self, raw: torch.Tensor) -> torch.Tensor:
        """Each row's logsumexp (float32 values, returned as float64); a row's value never
        depends on the other rows. With the fused ops on it is the fused greedy pick's own
        (:func:`batchgen.kernels.cpu.fused.logsumexp`), so that a greedy row gets the same
        logprob whichever path its batch takes; torch's otherwise, and for rows holding NaN or
        infinities."""
        lse = None
        if self.fused_greedy:
            lse = cpu_fused.logsumexp(raw)
        if lse is None:
            return torch.logsumexp(raw, dim=-1).double()
        bad = ~torch.isfinite(lse)
        if bool(bad.any()):
            lse[bad] = torch.logsumexp(raw[bad], dim=-1)
        return lse.double()

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
        device = x.device
        idx_t = torch.tensor(idx, device=device)
        sub = x[idx_t]
        ps = [rows[i].params for i in idx]
        # Both penalties touch only the tokens a row has seen: gather those logits, change
        # them, scatter them back (O(tokens) per row rather than O(vocab)). Each row's ids are
        # unique, so every scatter is deterministic.
        rep_rows = [j for j, p in enumerate(ps) if p.repetition_penalty != 1.0]
        if rep_rows:
            seen = [sorted(set(rows[idx[j]].prompt_token_ids) | set(rows[idx[j]].output_token_ids))
                    for j in rep_rows]
            keep = [j for j, ids in zip(rep_rows, seen) if ids]
            if keep:
                ids_t, _ = _padded_rows([ids for ids in seen if ids], None, device)
                keep_t = torch.tensor(keep, device=device)
                rep = torch.tensor([ps[j].repetition_penalty for j in keep], device=device)[:, None]
                seen_logits = sub[keep_t].gather(1, ids_t)
                # HF's RepetitionPenaltyLogitsProcessor: negative logits are multiplied by the
                # penalty, the others divided by it.
                penalised = torch.where(seen_logits < 0, seen_logits * rep, seen_logits / rep)
                sub[keep_t] = sub[keep_t].scatter_(1, ids_t, penalised)
        fp_rows = [j for j, p in enumerate(ps)
                   if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
                   and len(rows[idx[j]].output_token_ids) > 0]
        if fp_rows:
            id_lists: list[list[int]] = []
            amounts: list[list[float]] = []
            for j in fp_rows:
                counts = Counter(rows[idx[j]].output_token_ids)
                p = ps[j]
                id_lists.append(list(counts))
                amounts.append([p.frequency_penalty * c + p.presence_penalty
                                for c in counts.values()])
            ids_t, amount_t = _padded_rows(id_lists, amounts, device)
            assert amount_t is not None
            fp_t = torch.tensor(fp_rows, device=device)
            rows_sub = sub[fp_t]
            rows_sub.scatter_(1, ids_t, rows_sub.gather(1, ids_t) - amount_t)
            sub[fp_t] = rows_sub
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
        """Run the stateless logits processors; rows that share one processor list (e.g. the n
        samples of a request) are processed together in one call per processor. (Stateful
        ones in the same list run in :func:`apply_stateful`.)"""
        groups: dict[tuple[int, ...], tuple[list[Any], list[int]]] = {}
        for i, row in enumerate(rows):
            procs = [p for p in row.params.logits_processors if not is_stateful(p)]
            if procs:
                groups.setdefault(tuple(id(p) for p in procs), (procs, []))[1].append(i)
        for procs, idx in groups.values():
            idx_t = torch.tensor(idx, device=x.device)
            sub = x[idx_t]
            outputs = [list(rows[i].output_token_ids) for i in idx]
            for proc in procs:
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
        """Top-k, top-p then min-p on the sampled rows that use them (see :func:`apply_filters`)."""
        vocab = x.shape[1]
        idx = [i for i in sampled_idx
               if 0 < params[i].top_k < vocab or params[i].top_p < 1.0 or params[i].min_p > 0.0]
        if not idx:
            return
        idx_t = torch.tensor(idx, device=x.device)
        x[idx_t] = apply_filters(x[idx_t], [params[i].top_k for i in idx],
                                 [params[i].top_p for i in idx], [params[i].min_p for i in idx])

    @staticmethod
    def _sample(x: torch.Tensor, rows: list[SamplingRow], sampled_idx: list[int]) -> torch.Tensor:
        """Inverse-CDF draws for the sampled rows; returns their chosen token ids.

        Each row needs one uniform number: a seeded row draws it from its own generator (so its
        token does not depend on the batch), the others share one draw from the global RNG.
        The token is the first whose cumulative probability exceeds ``u * total``; a token of
        probability 0 spans an empty interval and can never be chosen.
        """
        device = x.device
        probs = torch.softmax(x[torch.tensor(sampled_idx, device=device)], dim=-1)
        u = torch.empty(len(sampled_idx), device=device)
        unseeded = [j for j, i in enumerate(sampled_idx) if rows[i].generator is None]
        if unseeded:
            u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), device=device)
        for j, i in enumerate(sampled_idx):
            gen = rows[i].generator
            if gen is not None:
                u[j] = torch.rand(1, device=device, generator=gen)[0]
        cdf = torch.cumsum(probs, dim=-1)
        target = (u * cdf[:, -1])[:, None]
        chosen = torch.searchsorted(cdf, target, right=True).squeeze(1)
        chosen.clamp_(max=probs.shape[1] - 1)
        # Rounding can put the target at the very top of the cdf, past the last token of
        # non-zero probability; such (rare) rows take that last token, never a masked one.
        off = probs.gather(1, chosen[:, None]).squeeze(1) == 0
        if bool(off.any()):
            rows = off.nonzero().flatten()
            positions = torch.arange(probs.shape[1], device=device)
            chosen[rows] = torch.where(probs[rows] > 0, positions, 0).amax(dim=-1)
        return chosen


def explain_masked(logits: torch.Tensor, row: SamplingRow) -> str:
    """Say what masks every token of ``row``: the first of its logits processors that does so
    alone (a constraint, a plugin's sampler, named by :func:`describe_processor`), else all of
    them together. ``logits`` is the row's raw ``[vocab]`` logits; runs only on that error."""
    base = logits.float().reshape(1, -1)
    after = f"after {len(row.output_token_ids)} generated token(s)"
    parts: list[str] = []
    for proc in row.params.logits_processors:
        if is_stateful(proc):
            continue  # in row.processors
        name = describe_processor(proc)
        if bool(torch.isneginf(proc(base.clone(), [list(row.output_token_ids)])).all()):
            return f"{name} masks every token {after}; nothing can be sampled"
        parts.append(name)
    for proc, state in zip(row.processors, row.states):
        name = describe_processor(proc, state)
        x = base.clone()
        apply_stateful(x, [[proc]], [[state]])
        if bool(torch.isneginf(x).all()):
            return f"{name} allows no token {after}: it can never match"
        parts.append(name)
    if row.suppress_token_ids:
        parts.append("min_tokens (the stop tokens are suppressed)")
    return f"{' and '.join(parts) or 'the filters'} together mask every token {after}; nothing can be sampled"
