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

from batchgen.sampling.params import SamplingParams, is_stateful
from batchgen.sampling.processors import describe_processor

__all__ = ["MaskedRowsError", "Sampler", "SamplerOutput", "SamplingRow", "apply_filters", "apply_stateful",
           "explain_masked", "unpack_bitmask", "top_candidates"]


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
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return SamplerOutput([], [], [])
        device = logits.device
        raw = logits.float()
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]

        modifies = not all(greedy) or any(
            r.suppress_token_ids or r.params.has_penalties or r.params.logits_processors
            or r.processors or r.params.temperature not in (0.0, 1.0) for r in rows)
        if self.fused_greedy and not modifies and all(p.logprobs is None for p in params):
            # Nothing below would change the logits: pick in one C pass where it can run.
            from batchgen.kernels.cpu import fused as cpu_fused

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

        # One row-wise max finds every row that cannot be sampled from: all -inf (masked
        # away), or holding a NaN or a +inf (the max propagates both).
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
        top: list[dict[int, float] | None] = [None] * num_rows
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k_max = min(max(params[i].logprobs or 0 for i in want), vocab)
            if k_max > 0:
                want_t = torch.tensor(want, device=device)
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
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _logsumexp(self, raw: torch.Tensor) -> torch.Tensor:
        """Each row's logsumexp (float32 values, returned as float64); a row's value never
        depends on the other rows. With the fused ops on it is the fused greedy pick's own
        (:func:`batchgen.kernels.cpu.fused.logsumexp`), so that a greedy row gets the same
        logprob whichever path its batch takes; torch's otherwise, and for rows holding NaN or
        infinities."""
        lse = None
        if self.fused_greedy:
            from batchgen.kernels.cpu import fused as cpu_fused

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
    is the ``candidates`` argument of :meth:`batchgen.sampling.beam.BeamSearchState.step`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
