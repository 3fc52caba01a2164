"""Prompt logprobs: which prompt positions a step scores, and what the request gets back.

Pure Python (no torch). A request with ``SamplingParams(prompt_logprobs=k)`` reports, for each
prompt token from ``prompt_logprobs_start`` on (default 1: every token but the first), the
token's logprob given the tokens before it, its rank and the top ``k`` alternatives (vLLM's
``RequestOutput.prompt_logprobs``). The logprob of token ``p`` comes from the logits at
position ``p - 1``, so:

* position ``p - 1`` must be computed for every scored token ``p``: the prefix cache may serve
  only whole blocks before position ``prompt_logprobs_start - 1``
  (:func:`max_cached_tokens`; the scheduler applies it);
* a prefill chunk covering positions ``c0 .. c1 - 1`` scores the tokens ``c0 + 1 .. c1``
  that are scored and in the prompt (:func:`plan_scores`); the model runner reduces their
  logits chunk by chunk (:mod:`batchgen.sampling.logprobs`) and fills each
  :class:`PromptScore`'s ``result``;
* a scoring-only request (``max_tokens=0``) runs the prompt but its last token: the logits
  of that last position score the last prompt token, and nothing is sampled
  (:func:`scoring_tokens`).

Recomputing a position (after a preemption) writes the same entry again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.outputs import Logprob
from batchgen.sampling.params import SamplingParams

__all__ = ["PromptScore", "wants_prompt_logprobs", "is_scoring_only", "scoring_tokens",
           "max_cached_tokens", "plan_scores", "score_rows", "split_result", "store", "build"]


@dataclass
class PromptScore:
    """The prompt tokens one scheduled sequence scores in this step.

    ``offset`` is the row, within the sequence's scheduled tokens, of the position whose
    logits score ``targets[0]``; ``targets[i]`` is prompt token ``first + i`` (scored from row
    ``offset + i``). The runner sets ``result`` (a
    :class:`batchgen.sampling.logprobs.TokenLogprobs`).
    """

    offset: int
    first: int
    targets: list[int]
    num_top: int
    result: Any = field(default=None, repr=False)


def wants_prompt_logprobs(params: Any) -> bool:
    return isinstance(params, SamplingParams) and params.prompt_logprobs is not None


def is_scoring_only(params: Any) -> bool:
    """No token is generated: the request only scores its prompt."""
    return isinstance(params, SamplingParams) and params.max_tokens == 0


def scoring_tokens(params: Any, prompt_token_ids: list[int]) -> list[int]:
    """The tokens the engine runs for a request's prompt: all of them, except that a
    scoring-only request of two or more tokens leaves out its last token (no logits after it
    are needed)."""
    if is_scoring_only(params) and len(prompt_token_ids) >= 2:
        return list(prompt_token_ids[:-1])
    return list(prompt_token_ids)


def _start(params: SamplingParams) -> int:
    return max(1, params.prompt_logprobs_start if params.prompt_logprobs_start is not None else 1)


def max_cached_tokens(params: Any) -> int | None:
    """The most leading tokens a prefix-cache hit may cover for this request (None: no limit
    beyond the scheduler's own)."""
    if not wants_prompt_logprobs(params):
        return None
    return _start(params) - 1


def plan_scores(scheduled: list[tuple[Any, int]], group_of: dict[int, Any]) -> list[PromptScore | None] | None:
    """One :class:`PromptScore` (or None) per scheduled ``(sequence, tokens)``; None when no
    sequence of the step scores anything. ``group_of`` maps ``id(sequence)`` to its group."""
    scores: list[PromptScore | None] = []
    any_score = False
    for seq, n in scheduled:
        group = group_of.get(id(seq))
        score = None
        if group is not None and wants_prompt_logprobs(group.params):
            prompt = group.prompt_token_ids
            c0 = seq.num_computed_tokens
            first = max(c0 + 1, _start(group.params))  # the first token scored from this chunk
            last = min(c0 + n, len(prompt) - 1)  # the last one: its logits row is the chunk's end
            if first <= last:
                score = PromptScore(offset=first - 1 - c0, first=first, targets=list(prompt[first:last + 1]),
                                    num_top=group.params.prompt_logprobs)
                any_score = True
        scores.append(score)
    return scores if any_score else None


def score_rows(scheduled: list[tuple[Any, int]], scores: list[PromptScore | None]) -> tuple[list[int], list[int], int]:
    """The rows of the packed step (scheduled tokens in order) that score, their target ids,
    and the largest ``num_top``: what the model runner reduces."""
    rows: list[int] = []
    targets: list[int] = []
    offset = 0
    for (_, n), score in zip(scheduled, scores):
        if score is not None:
            rows.extend(range(offset + score.offset, offset + score.offset + len(score.targets)))
            targets.extend(score.targets)
        offset += n
    return rows, targets, max((s.num_top for s in scores if s is not None), default=0)


def split_result(result: Any, scores: list[PromptScore | None]) -> None:
    """Hand each score its slice of the step's reduced ``result`` (a ``TokenLogprobs`` over the
    rows of :func:`score_rows`), its top lists cut to its own ``num_top``."""
    first = 0
    for score in scores:
        if score is None:
            continue
        end, k = first + len(score.targets), score.num_top
        score.result = type(result)(result.logprobs[first:end], result.ranks[first:end],
                                    [t[:k] for t in result.top_ids[first:end]],
                                    [t[:k] for t in result.top_logprobs[first:end]])
        first = end


def store(group: Any, score: PromptScore) -> None:
    """Keep a step's results on the group: ``group.prompt_logprobs[p]`` becomes
    ``(logprob, rank, top ids, top logprobs)`` of prompt token ``p``."""
    table = group.prompt_logprobs
    if table is None:
        table = group.prompt_logprobs = [None] * len(group.prompt_token_ids)
    r = score.result
    for i in range(len(score.targets)):
        table[score.first + i] = (r.logprobs[i], r.ranks[i], r.top_ids[i], r.top_logprobs[i])


def build(group: Any, tokenizer: Any) -> list[dict[int, Logprob] | None] | None:
    """``RequestOutput.prompt_logprobs`` of a request: None unless asked for; else one entry
    per prompt token, None for the first (and for any before ``prompt_logprobs_start``), then
    ``{token_id: Logprob}`` with the prompt token's entry first and the top
    ``prompt_logprobs`` tokens (best first); ``decoded_token`` is each id decoded alone."""
    if not wants_prompt_logprobs(group.params):
        return None
    prompt = group.prompt_token_ids
    table = group.prompt_logprobs or [None] * len(prompt)
    ids = {t for p, entry in enumerate(table) if entry is not None for t in (prompt[p], *entry[2])}
    order = sorted(ids)
    texts = dict(zip(order, tokenizer.batch_decode([[t] for t in order]))) if order else {}
    out: list[dict[int, Logprob] | None] = []
    for p, entry in enumerate(table):
        if entry is None:
            out.append(None)
            continue
        logprob, rank, top_ids, top_logprobs = entry
        token = prompt[p]
        d = {token: Logprob(logprob, rank, texts[token])}
        for j, (t, lp) in enumerate(zip(top_ids, top_logprobs)):
            if t not in d:
                d[t] = Logprob(lp, j + 1, texts[t])
        out.append(d)
    return out
