"""OpenAI response lines as a :class:`~batchgen.io.protocols.RecordFormat` (``output.format:
openai_batch``): built by :class:`~batchgen.openai_batch.responses.ResponseBuilder`, read back
by their ``custom_id``, with an on-disk resume index.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from batchgen.config import RunConfig
from batchgen.io.protocols import EngineView, PromptRecord
from batchgen.openai_batch.batch_file import AnsweredOnDisk
from batchgen.openai_batch.requests import BatchPrompt
from batchgen.openai_batch.responses import ResponseBuilder, is_failed, response_key

__all__ = ["ResponseLines"]


class _ResponseLineBuilder:
    """A run's :class:`~batchgen.io.protocols.RecordBuilder`: a batch line answers as its url
    asks; a dataset row as its template was applied (chat completion or text completion)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.inner = builder

    def make(self, prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
        if not isinstance(prompt, BatchPrompt):
            self.inner.chat = bool(prompt.chat)
        return self.inner.make(prompt, output)


class ResponseLines:
    """OpenAI response lines (see :class:`~batchgen.io.protocols.RecordFormat`)."""

    def __init__(self, config: RunConfig) -> None:
        self.model = config.model.name
        self.top_logprobs = config.generation.logprobs  # for rows of a dataset

    def builder(self, engine: EngineView) -> _ResponseLineBuilder:
        return _ResponseLineBuilder(ResponseBuilder(self.model, engine.tokenizer, top_logprobs=self.top_logprobs))

    key = staticmethod(response_key)
    failed = staticmethod(is_failed)
    output_tokens = staticmethod(ResponseBuilder.output_tokens)
    describe_error = staticmethod(ResponseBuilder.describe_error)

    def resume_index(self, records: Iterable[Mapping[str, Any]]) -> AnsweredOnDisk:
        """On disk: an output file may answer more lines than fit in memory."""
        return AnsweredOnDisk.of(records, self.key)

    @staticmethod
    def example(described: Mapping[str, Any]) -> str:
        return f"custom_id {described.get('custom_id')!r}: {described.get('error')}"

    @staticmethod
    def summary_counts(counts: Mapping[str, Any]) -> dict[str, Any]:
        """As OpenAI's Batch object counts them."""
        failed = counts.get("error", counts.get("this_run_error", 0))
        return {"request_counts": {"total": counts["total"], "completed": counts["total"] - failed, "failed": failed}}
