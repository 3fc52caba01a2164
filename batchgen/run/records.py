"""``output.format: jsonl``: batchgen's own records (a :class:`~batchgen.io.protocols.RecordFormat`).

A record is ``{"id", "index", "prompt", "generations", "metrics", "error", "usage"}`` (see
docs/config.md, "Output records"). Generations are listed best first: by rank for beam search,
by index otherwise. The job's metrics score each record as it is made; a metric that fails for
one record sets that record's error and keeps its generations.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from batchgen.plugins import PluginError
from batchgen.io.protocols import AnsweredKeys, EngineView, PromptRecord
from batchgen.sampling.params import BeamSearchParams

__all__ = ["BatchgenRecords", "make_record"]


def _generation(completion: Any, beam: bool, with_logprobs: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "index": completion.index,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "cumulative_logprob": completion.cumulative_logprob,
        "num_tokens": len(completion.token_ids),
    }
    if beam:
        entry["score"] = completion.score
    if with_logprobs:
        entry["logprobs"] = completion.logprobs
    return entry


def make_record(prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
    """The record of one row; ``output`` is the engine's RequestOutput, or None for a row that
    never reached the engine (then ``prompt.error`` is set)."""
    usage = {"prompt_tokens": len(prompt.prompt_token_ids or ()), "generated_tokens": 0, "cached_tokens": 0}
    generations: list[dict[str, Any]] = []
    error = prompt.error
    if output is not None:
        stats = output.stats
        usage = {
            "prompt_tokens": stats.num_prompt_tokens or len(output.prompt_token_ids or ()),
            "generated_tokens": stats.num_generated_tokens,
            "cached_tokens": stats.num_cached_tokens,
        }
        error = output.error
        if isinstance(prompt.params, BeamSearchParams):
            # Best beam first, indexed by rank, so that "the first generation" means the same
            # thing (the model's best answer) in every mode.
            ranked = sorted(output.outputs, key=lambda c: -c.score if c.score is not None else float("inf"))
            generations = [_generation(c, True, False) | {"index": rank} for rank, c in enumerate(ranked)]
        else:
            with_logprobs = getattr(prompt.params, "logprobs", None) is not None
            generations = [_generation(c, False, with_logprobs) for c in sorted(output.outputs, key=lambda c: c.index)]
    return {
        "id": prompt.id,
        "index": prompt.index,
        "prompt": prompt.prompt,
        "generations": generations,
        "metrics": {},
        "error": error,
        "usage": usage,
    }


def score_record(record: dict[str, Any], row: Any, metrics: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    """Score an ok ``record`` with each ``(MetricRef, metric)`` under ``record["metrics"]``;
    the first metric that fails makes it an error record naming its plugin. Returns ``record``."""
    if record["error"] is None:
        for ref, metric in metrics:
            try:
                record["metrics"][ref.key] = metric.score(record, row)
            except PluginError as exc:
                record["error"] = str(exc)
                break
    return record


class _RecordBuilder:
    """Makes and scores the records of one run."""

    def __init__(self, metrics: Sequence[tuple[Any, Any]]) -> None:
        self.metrics = metrics

    def make(self, prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
        return score_record(make_record(prompt, output), prompt.row, self.metrics)


class BatchgenRecords:
    """batchgen's records, made and read back.

    Args:
        metrics: the job's ``(MetricRef, metric)`` pairs; each scores every ok record under
            ``metrics.<ref.key>``.
    """

    def __init__(self, metrics: Sequence[tuple[Any, Any]] = ()) -> None:
        self.metrics = list(metrics)

    def builder(self, engine: EngineView) -> _RecordBuilder:
        return _RecordBuilder(self.metrics)

    @staticmethod
    def key(record: Mapping[str, Any]) -> str | None:
        """The row id a record answers (None for a row that had none)."""
        value = record.get("id")
        return None if value is None else str(value)

    def resume_index(self, records: Iterable[Mapping[str, Any]]) -> AnsweredKeys:
        return AnsweredKeys.of(records, self.key)

    @staticmethod
    def failed(record: Mapping[str, Any]) -> bool:
        """True for an error record."""
        return record.get("error") is not None

    @staticmethod
    def output_tokens(record: Mapping[str, Any]) -> int:
        """The tokens a record keeps (``usage.generated_tokens``)."""
        return int((record.get("usage") or {}).get("generated_tokens") or 0)

    @staticmethod
    def describe_error(record: Mapping[str, Any]) -> dict[str, Any]:
        """``{"id", "error"}`` of a record, for the summary's ``first_error`` and messages."""
        return {"id": record.get("id"), "error": record.get("error")}

    @staticmethod
    def example(described: Mapping[str, Any]) -> str:
        return f"id {described.get('id')!r}: {described.get('error')}"

    @staticmethod
    def summary_counts(counts: Mapping[str, Any]) -> dict[str, Any]:
        return {}
