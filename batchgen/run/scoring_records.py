"""The records of a scoring job (a :class:`~batchgen.io.protocols.RecordFormat`, picked by
``generation.mode: loglikelihood`` or ``perplexity`` with ``output.format: jsonl``/``auto``).

A ``loglikelihood`` record::

    {"id", "index", "prompt",                      # the context as scored
     "choices": [{"text", "logprob", "num_tokens", "is_greedy"}, ...],
     "chosen", "chosen_norm", "answer",            # argmax, argmax of logprob / UTF-8 bytes, the right index
     "metrics", "error", "usage"}

``logprob`` is the sum of the choice's token logprobs given the context and ``is_greedy``
whether each of its tokens was the most likely one (``LLM.loglikelihood``'s pair);
``num_tokens`` counts the choice's own tokens (before any truncation of the context).
``chosen_norm`` normalises by the UTF-8 byte length of the choice's text (without the target
delimiter), as lm-eval's ``acc_norm`` normalises by its length (characters; the same for ASCII).

A ``perplexity`` record::

    {"id", "index", "loglikelihood", "num_tokens", "num_words", "num_bytes", "num_windows",
     "metrics", "error", "usage"}

``loglikelihood`` is ``LLM.loglikelihood_rolling`` of the row's text. The job's metrics score
each ok record as it is made (``accuracy``, ``accuracy_norm``, ``perplexity``: see
:mod:`batchgen.plugins.scoring_metrics`). Usage counts the prompt tokens of all the row's
requests, and the cached ones (a shared context counts once per choice in ``prompt_tokens``).

This module imports neither torch nor the engine at import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.io.protocols import EngineView, PromptRecord
from batchgen.run.records import BatchgenRecords, score_record

__all__ = ["ScoringRecords", "results_table"]


def _usage(outputs: Sequence[Any]) -> dict[str, int]:
    return {
        "prompt_tokens": sum(o.stats.num_prompt_tokens or len(o.prompt_token_ids or ()) for o in outputs),
        "generated_tokens": 0,
        "cached_tokens": sum(o.stats.num_cached_tokens or 0 for o in outputs),
    }


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # the first of equal ones, as numpy's


class _ScoringRecordBuilder:
    def __init__(self, mode: str, metrics: Sequence[tuple[Any, Any]]) -> None:
        self.mode = mode
        self.metrics = metrics

    def make(self, prompt: PromptRecord, output: Any) -> dict[str, Any]:
        return score_record(self._record(prompt, output), prompt.row, self.metrics)

    def _record(self, prompt: PromptRecord, outputs: Any) -> dict[str, Any]:
        head: dict[str, Any] = {"id": prompt.id, "index": prompt.index}
        if self.mode == "loglikelihood":
            head["prompt"] = prompt.prompt
        usage = {"prompt_tokens": 0, "generated_tokens": 0, "cached_tokens": 0}
        body, error = {}, prompt.error
        if error is None and outputs is not None:
            usage = _usage(outputs)
            body, error = self._scores(prompt, outputs)
        return head | body | {"metrics": {}, "error": error, "usage": usage}

    def _scores(self, prompt: PromptRecord, outputs: Sequence[Any]) -> tuple[dict[str, Any], str | None]:
        """The record's scoring fields, or ``({}, why not)`` when one of its requests failed."""
        from batchgen.engine.loglikelihood import loglikelihood_of

        what = "choice" if self.mode == "loglikelihood" else "window"
        scores = []
        for j, output in enumerate(outputs):
            try:
                scores.append(loglikelihood_of(output))
            except ValueError:
                return {}, f"{what} {j}: {output.error or 'the engine returned no prompt logprobs'}"
        meta = prompt.meta
        if self.mode == "perplexity":
            return {"loglikelihood": sum(lp for lp, _ in scores), "num_tokens": meta["num_tokens"],
                    "num_words": meta["num_words"], "num_bytes": meta["num_bytes"], "num_windows": len(scores)}, None
        choices = meta["choices"]
        logprobs = [lp for lp, _ in scores]
        return {
            "choices": [{"text": text, "logprob": lp, "num_tokens": n, "is_greedy": greedy}
                        for text, (lp, greedy), n in zip(choices, scores, meta["num_tokens"])],
            "chosen": _argmax(logprobs),
            "chosen_norm": _argmax([lp / max(len(t.encode("utf-8")), 1) for lp, t in zip(logprobs, choices)]),
            "answer": meta["answer"],
        }, None


class ScoringRecords(BatchgenRecords):
    """A scoring job's records, made and read back (keys, errors and counts as batchgen's
    records: ``id``, ``error``, no generated tokens)."""

    def __init__(self, mode: str, metrics: Sequence[tuple[Any, Any]] = ()) -> None:
        super().__init__(metrics)
        self.mode = mode

    def builder(self, engine: EngineView) -> _ScoringRecordBuilder:  # type: ignore[override]
        return _ScoringRecordBuilder(self.mode, self.metrics)


def results_table(metrics: Mapping[str, Mapping[str, Any]]) -> str:
    """The run's metrics as a Markdown table, as lm-eval prints its results."""
    names = [name for values in metrics.values() for name in values]
    rows = [(name if names.count(name) == 1 else f"{key}.{name}", value)
            for key, values in metrics.items() for name, value in values.items()]
    shown = [(name, f"{value:.4f}" if isinstance(value, float) else str(value)) for name, value in rows]
    width = max([len("metric"), *(len(name) for name, _ in shown)])
    vwidth = max([len("value"), *(len(v) for _, v in shown)])
    lines = [f"| {'metric':<{width}} | {'value':>{vwidth}} |", f"|{'-' * (width + 2)}|{'-' * (vwidth + 1)}:|"]
    lines += [f"| {name:<{width}} | {value:>{vwidth}} |" for name, value in shown]
    return "\n".join(lines)
