"""OpenAI Batch files in the run layer: the batch file as a
:class:`~batchgen.io.protocols.PromptSource` and OpenAI response lines as a
:class:`~batchgen.io.protocols.RecordFormat`, over :mod:`batchgen.openai_batch` (which parses
the lines and builds the response bodies).

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from batchgen import openai_batch as oa
from batchgen.config import RunConfig
from batchgen.io.protocols import EngineView, Preview, PromptRecord, ResumeIndex

__all__ = ["BatchLines", "ResponseLines"]


class _Done:
    """What :meth:`openai_batch.BatchFile.prompts` reads: the answered keys, and which lines
    were read first (duplicates), in a private on-disk table."""

    def __init__(self, answered: ResumeIndex) -> None:
        self.answered = answered
        self.keyless = answered.keyless
        self._seen = oa.ResumeIndex()

    def __contains__(self, key: object) -> bool:
        return key in self.answered

    def first_line(self, custom_id: str, line: int) -> int | None:
        return self._seen.first_line(custom_id, line)


class BatchLines:
    """The lines of an OpenAI batch file (``data.format: openai_batch``), streamed.

    Raises DataError / ConfigError when built (see :func:`openai_batch.open_input`).
    """

    def __init__(self, config: RunConfig, logits_processors: Sequence[Any] = (),
                 metric_columns: dict[str, Iterable[str]] | None = None) -> None:
        self.file = oa.open_input(config, metric_columns)
        self.columns = self.file.columns
        self.model_names = [config.model.name, *config.model.aliases]
        self.source = config.data.source
        self.logits_processors = list(logits_processors)

    def __len__(self) -> int:
        return len(self.file)

    def todo(self, answered: ResumeIndex) -> int:
        return self.file.todo(answered)  # type: ignore[arg-type]

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        parser = oa.LineParser(engine.tokenizer, engine.max_model_len, self.model_names, self.logits_processors)
        return self.file.prompts(parser, _Done(answered))  # type: ignore[arg-type]

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        # A bad line only fails itself: the first lines' problems are notes, not errors.
        notes = self.file.preview(tokenizer, self.model_names, rows)
        return Preview(f"{len(self)} lines in {self.source}, the first {rows} checked", notes=notes)


class _Builder:
    def __init__(self, builder: oa.ResponseBuilder) -> None:
        self.inner = builder

    def make(self, prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
        if not isinstance(prompt, oa.BatchPrompt):  # a dataset row: answered as its template was
            self.inner.chat = bool(prompt.chat)
        return self.inner.make(prompt, output)


class ResponseLines:
    """OpenAI response lines (``output.format: openai_batch``); its resume index lives on disk."""

    def __init__(self, config: RunConfig) -> None:
        self.model = config.model.name
        self.top_logprobs = config.generation.logprobs  # for rows of a dataset

    def builder(self, engine: EngineView) -> _Builder:
        return _Builder(oa.ResponseBuilder(self.model, engine.tokenizer, top_logprobs=self.top_logprobs))

    key = staticmethod(oa.response_key)
    failed = staticmethod(oa.is_failed)
    output_tokens = staticmethod(oa.ResponseBuilder.output_tokens)
    describe_error = staticmethod(oa.ResponseBuilder.describe_error)

    def resume_index(self, records: Iterable[Mapping[str, Any]]) -> oa.ResumeIndex:
        index = oa.ResumeIndex()
        for record in records:  # as ResumeIndex.load does for one file
            value = self.key(record)
            if value is None:
                index.keyless += 1
            else:
                index.num_answered += index._db.execute(
                    "INSERT OR IGNORE INTO answered VALUES (?)", (value,)).rowcount
        return index

    @staticmethod
    def example(described: Mapping[str, Any]) -> str:
        return f"custom_id {described.get('custom_id')!r}: {described.get('error')}"

    @staticmethod
    def summary_counts(counts: Mapping[str, Any]) -> dict[str, Any]:
        """As OpenAI's Batch object counts them."""
        failed = counts.get("error", counts.get("this_run_error", 0))
        return {"request_counts": {"total": counts["total"], "completed": counts["total"] - failed, "failed": failed}}
