"""The batch file as a :class:`~batchgen.io.protocols.PromptSource` (``data.format:
openai_batch``): its lines, streamed, each with its own prompt and engine params.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from batchgen.config import RunConfig
from batchgen.io.protocols import EngineView, Preview, PromptRecord, ResumeIndex
from batchgen.openai_batch.batch_file import open_input
from batchgen.openai_batch.requests import LineParser

__all__ = ["BatchLines"]


class BatchLines:
    """The lines of an OpenAI batch file, streamed (see :class:`~batchgen.io.protocols.PromptSource`).

    Raises DataError / ConfigError when built (see :func:`~batchgen.openai_batch.open_input`).
    """

    def __init__(self, config: RunConfig, logits_processors: Sequence[Any] = (),
                 metric_columns: dict[str, Iterable[str]] | None = None) -> None:
        self.file = open_input(config, metric_columns)
        self.columns = self.file.columns
        self.model_names = [config.model.name, *config.model.aliases]
        self.source = config.data.source
        self.logits_processors = list(logits_processors)

    def __len__(self) -> int:
        return len(self.file)

    def todo(self, answered: ResumeIndex) -> int:
        return self.file.todo(answered)

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        parser = LineParser(engine.tokenizer, engine.max_model_len, self.model_names, self.logits_processors)
        return self.file.prompts(parser, answered)

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        # A bad line only fails itself: the first lines' problems are notes, not errors.
        notes = self.file.preview(tokenizer, self.model_names, rows)
        return Preview(f"{len(self)} lines in {self.source}, the first {rows} checked", notes=notes)
