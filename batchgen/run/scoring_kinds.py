"""How each scoring kind runs: the requests of a row, its check at ``validate``, and the fields
of its record. :data:`SCORERS` is the one table, keyed by the config's
:class:`~batchgen.config.formats.ScoringKind` (picked by ``generation.mode``, see
:func:`batchgen.config.formats.scoring_kind`); :func:`batchgen.run.plan.pick` hands the kind's
scorer to :class:`~batchgen.run.scoring_rows.ScoringRows` and
:class:`~batchgen.run.scoring_records.ScoringRecords`, which never test a mode's name.

* ``loglikelihood`` (:class:`ChoiceScorer`): the prompt is the context; each choice, with
  ``generation.target_delimiter`` before it, is one ``(context, continuation)`` request;
* ``perplexity`` (:class:`RollingScorer`): the prompt text in lm-eval's disjoint rolling
  windows of the model's length, one request per window.

Requests are built exactly as ``LLM.loglikelihood`` and ``LLM.loglikelihood_rolling`` build
theirs (:mod:`batchgen.engine.loglikelihood`), so a job's numbers are the API's. The same rule
for text holds for both: text is scored when it has at least one token (whitespace included, as
the API and lm-eval's ``hf`` model score it); only text with no tokens of its own is refused.

This module imports no torch: of the engine it imports only the torch-free
:mod:`batchgen.engine.loglikelihood` (docs/architecture.md, "Layering").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from batchgen.config.formats import LOGLIKELIHOOD, PERPLEXITY, ScoringKind
from batchgen.engine import loglikelihood as ll
from batchgen.io.protocols import EngineView, PromptRecord
from batchgen.plugins.scoring_metrics import normalized_choice

__all__ = ["SCORERS", "ChoiceScorer", "RollingScorer", "Scorer", "answer_index", "count_words"]


def count_words(text: str) -> int:
    """Words as lm-eval's ``wikitext`` counts them: the pieces of ``re.split(r"\\s+", text)``."""
    return len(re.split(r"\s+", text))


def answer_index(value: Any, choices: list[str]) -> int:
    """The index of the right choice from an answer column's value. Raises ValueError naming
    what is wrong.

    The value may be the choice's index (an int, or a string of digits), or the text of one of
    the row's choices as scored (what ``generation.choices`` rendered, before
    ``target_delimiter``): the exact text, or the text up to surrounding whitespace when exactly
    one choice matches so. When the choices are labels (``["A", "B", "C", "D"]``) the answer is
    a label or an index, never the text of the option the label stands for.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"the answer is {value!r}; expected the index of a choice or its text")
    if isinstance(value, int):
        if not 0 <= value < len(choices):
            raise ValueError(f"the answer index {value} is out of range: the row has {len(choices)} choices "
                             f"(0..{len(choices) - 1})")
        return value
    if isinstance(value, str):
        if value in choices:
            return choices.index(value)
        if value.strip().lstrip("-").isdigit():
            return answer_index(int(value), choices)
        loose = [i for i, c in enumerate(choices) if c.strip() == value.strip()]
        if len(loose) == 1:
            return loose[0]
        shown = ", ".join(repr(c) for c in choices[:6]) + (", ..." if len(choices) > 6 else "")
        raise ValueError(f"the answer {value!r} is none of the row's choices ({shown}); the answer must be the "
                         f"text of one of them or its index (0..{len(choices) - 1})")
    raise ValueError(f"the answer holds {type(value).__name__}; expected the index of a choice or its text")


class Scorer:
    """What a scoring kind does at run time. ``rows`` is the job's
    :class:`~batchgen.run.scoring_rows.ScoringRows` (its config, choices and answers)."""

    kind: ScoringKind

    def requests(self, rows: Any, prompt: PromptRecord, engine: EngineView) -> None:
        """Fill ``prompt.requests`` and ``prompt.meta`` (ValueError: the row cannot run)."""
        raise NotImplementedError

    def check(self, rows: Any, prompt: PromptRecord, tokenizer: Any) -> None:
        """What can be checked of a row without a model, and with the model's tokenizer when
        there is one (ValueError: the row would fail; a pair too long shows only at run)."""

    def head(self, prompt: PromptRecord) -> dict[str, Any]:
        """The record's fields after ``id`` and ``index``."""
        return {}

    def fields(self, prompt: PromptRecord, scores: Sequence[tuple[float, bool]]) -> dict[str, Any]:
        """The record's scoring fields from its requests' ``(logprob, is_greedy)``."""
        raise NotImplementedError


def _answer(rows: Any, row: dict[str, Any], choices: list[str]) -> int | None:
    column = rows.gen.answer
    if column is None:
        return None
    if row.get(column) is None:
        raise ValueError(f"the row has no '{column}' field (generation.answer): expected the index of the "
                         "right choice or its text")
    return answer_index(row[column], choices)


def _continuation(tokenizer: Any, context: str, delimiter: str, choice: str, j: int) -> tuple[list[int], list[int]]:
    """The pair's tokens (ValueError when the choice has no tokens of its own to score)."""
    context_ids, continuation_ids = ll.encode_pair(tokenizer, context, delimiter + choice)
    if not continuation_ids:
        what = "is empty" if not (delimiter + choice) else f"({choice!r:.40}) has no tokens of its own"
        raise ValueError(f"choice {j} {what} (nothing to score)")
    return context_ids, continuation_ids


class ChoiceScorer(Scorer):
    """Multiple choice (``generation.mode: loglikelihood``)."""

    kind = LOGLIKELIHOOD

    def check(self, rows: Any, prompt: PromptRecord, tokenizer: Any) -> None:
        choices = rows.choices_of(prompt.row, prompt.index)
        _answer(rows, prompt.row, choices)
        for j, choice in enumerate(choices):
            if tokenizer is not None:
                _continuation(tokenizer, prompt.prompt or "", rows.gen.target_delimiter, choice, j)

    def requests(self, rows: Any, prompt: PromptRecord, engine: EngineView) -> None:
        gen = rows.gen
        choices = rows.choices_of(prompt.row, prompt.index)
        answer = _answer(rows, prompt.row, choices)
        requests, counts = [], []
        for j, choice in enumerate(choices):
            context_ids, continuation_ids = _continuation(engine.tokenizer, prompt.prompt or "",
                                                          gen.target_delimiter, choice, j)
            fitted = ll.fit_window(context_ids, continuation_ids, engine.max_model_len, gen.truncate)
            if isinstance(fitted, str):
                raise ValueError(f"choice {j}: {fitted}; set generation.truncate: true to score it anyway")
            requests.append(ll.to_request(f"{prompt.id}\x1fc{j}", *fitted))
            counts.append(len(continuation_ids))
        prompt.requests = requests
        prompt.meta = {"choices": choices, "num_tokens": counts, "answer": answer}

    def head(self, prompt: PromptRecord) -> dict[str, Any]:
        return {"prompt": prompt.prompt}

    def fields(self, prompt: PromptRecord, scores: Sequence[tuple[float, bool]]) -> dict[str, Any]:
        choices = [{"text": text, "logprob": lp, "num_tokens": n, "is_greedy": greedy}
                   for text, (lp, greedy), n in zip(prompt.meta["choices"], scores, prompt.meta["num_tokens"])]
        logprobs = [lp for lp, _ in scores]
        return {"choices": choices, "chosen": max(range(len(logprobs)), key=lambda i: logprobs[i]),
                "chosen_norm": normalized_choice(choices), "answer": prompt.meta["answer"]}


class RollingScorer(Scorer):
    """A text's rolling log-likelihood (``generation.mode: perplexity``)."""

    kind = PERPLEXITY

    def requests(self, rows: Any, prompt: PromptRecord, engine: EngineView) -> None:
        text = prompt.prompt or ""
        tokens = ll.encode(engine.tokenizer, text)
        if not tokens:
            raise ValueError("the text is empty (it has no tokens to score)")
        windows = ll.rolling_windows(tokens, ll.prefix_token_id(engine.tokenizer), engine.max_model_len)
        prompt.requests = [ll.to_request(f"{prompt.id}\x1fw{j}", ctx, cont) for j, (ctx, cont) in enumerate(windows)]
        prompt.meta = {"num_tokens": len(tokens), "num_words": count_words(text), "num_bytes": len(text.encode("utf-8"))}

    def check(self, rows: Any, prompt: PromptRecord, tokenizer: Any) -> None:
        if not prompt.prompt or (tokenizer is not None and not ll.encode(tokenizer, prompt.prompt)):
            raise ValueError("the text is empty (it has no tokens to score)")

    def fields(self, prompt: PromptRecord, scores: Sequence[tuple[float, bool]]) -> dict[str, Any]:
        meta = prompt.meta
        return {"loglikelihood": sum(lp for lp, _ in scores), "num_tokens": meta["num_tokens"],
                "num_words": meta["num_words"], "num_bytes": meta["num_bytes"], "num_windows": len(scores)}


#: The scorer of each scoring kind (the run-time half of :data:`batchgen.config.formats.SCORING_KINDS`).
SCORERS: dict[ScoringKind, Scorer] = {LOGLIKELIHOOD: ChoiceScorer(), PERPLEXITY: RollingScorer()}
