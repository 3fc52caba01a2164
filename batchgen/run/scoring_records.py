"""The records of a scoring job (a :class:`~batchgen.io.protocols.RecordFormat`, picked by
``generation.mode: loglikelihood`` or ``perplexity`` with ``output.format: jsonl``/``auto``);
the fields of each kind come from its scorer (:data:`batchgen.run.scoring_kinds.SCORERS`).

A ``loglikelihood`` record::

    {"id", "index", "prompt",                      # the context as scored
     "choices": [{"text", "logprob", "num_tokens", "is_greedy"}, ...],
     "chosen", "chosen_norm", "answer",            # argmax, argmax of logprob / characters, the right index
     "metrics", "error", "usage"}

``logprob`` is the sum of the choice's token logprobs given the context and ``is_greedy``
whether each of its tokens was the most likely one (``LLM.loglikelihood``'s pair);
``num_tokens`` counts the choice's own tokens (before any truncation of the context).
``chosen_norm`` normalises by the length in characters of the choice's text (without the target
delimiter), as lm-eval's ``acc_norm`` does (the ``accuracy_norm`` metric's rule,
:func:`batchgen.plugins.scoring_metrics.normalized_choice`).

A ``perplexity`` record::

    {"id", "index", "loglikelihood", "num_tokens", "num_words", "num_bytes", "num_windows",
     "metrics", "error", "usage"}

``loglikelihood`` is ``LLM.loglikelihood_rolling`` of the row's text. The job's metrics score
each ok record as it is made (``accuracy``, ``accuracy_norm``, ``perplexity``: see
:mod:`batchgen.plugins.scoring_metrics`). Usage counts the prompt tokens of all the row's
requests, and the cached ones (a shared context counts once per choice in ``prompt_tokens``).

This module imports no torch (of the engine, only the torch-free :mod:`batchgen.engine.loglikelihood`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.engine.loglikelihood import loglikelihood_of
from batchgen.io.protocols import EngineView, PromptRecord
from batchgen.run.records import BatchgenRecords, score_record
from batchgen.run.scoring_kinds import Scorer

__all__ = ["ScoringRecords", "results_table"]


def _usage(outputs: Sequence[Any]) -> dict[str, int]:
    return {
        "prompt_tokens": sum(o.stats.num_prompt_tokens or len(o.prompt_token_ids or ()) for o in outputs),
        "generated_tokens": 0,
        "cached_tokens": sum(o.stats.num_cached_tokens or 0 for o in outputs),
    }


class _ScoringRecordBuilder:
    def __init__(self, scorer: Scorer, metrics: Sequence[tuple[Any, Any]]) -> None:
        self.scorer = scorer
        self.metrics = metrics

    def make(self, prompt: PromptRecord, output: Any) -> dict[str, Any]:
        return score_record(self._record(prompt, output), prompt.row, self.metrics)

    def _record(self, prompt: PromptRecord, outputs: Any) -> dict[str, Any]:
        head: dict[str, Any] = {"id": prompt.id, "index": prompt.index} | self.scorer.head(prompt)
        usage = {"prompt_tokens": 0, "generated_tokens": 0, "cached_tokens": 0}
        body, error = {}, prompt.error
        if error is None and outputs is not None:
            usage = _usage(outputs)
            body, error = self._scores(prompt, outputs)
        return head | body | {"metrics": {}, "error": error, "usage": usage}

    def _scores(self, prompt: PromptRecord, outputs: Sequence[Any]) -> tuple[dict[str, Any], str | None]:
        """The record's scoring fields, or ``({}, why not)`` when one of its requests failed."""
        scores = []
        for j, output in enumerate(outputs):
            try:
                scores.append(loglikelihood_of(output))
            except ValueError:
                return {}, f"{self.scorer.kind.what} {j}: {output.error or 'the engine returned no prompt logprobs'}"
        return self.scorer.fields(prompt, scores), None


class ScoringRecords(BatchgenRecords):
    """A scoring job's records, made and read back (keys, errors and counts as batchgen's
    records: ``id``, ``error``, no generated tokens)."""

    def __init__(self, scorer: Scorer, metrics: Sequence[tuple[Any, Any]] = ()) -> None:
        super().__init__(metrics)
        self.scorer = scorer

    def builder(self, engine: EngineView) -> _ScoringRecordBuilder:  # type: ignore[override]
        return _ScoringRecordBuilder(self.scorer, self.metrics)


def results_table(metrics: Mapping[str, Mapping[str, Any]],
                  coverage: Mapping[str, Mapping[str, int]] | None = None) -> str:
    """The run's metrics as a Markdown table, as lm-eval prints its results, with the rows each
    metric covers and the rows that failed (``coverage``: the summary's ``{key: {"rows",
    "failed"}}``)."""
    coverage = coverage or {}
    names = [name for values in metrics.values() for name in values]
    shown = []
    for key, values in metrics.items():
        rows = coverage.get(key) or {}
        for name, value in values.items():
            shown.append((name if names.count(name) == 1 else f"{key}.{name}",
                          f"{value:.4f}" if isinstance(value, float) else str(value),
                          str(rows.get("rows", "")), str(rows.get("failed", ""))))
    header = ("metric", "value", "rows", "failed")
    widths = [max(len(header[i]), *(len(row[i]) for row in shown)) if shown else len(header[i]) for i in range(4)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in shown)])
