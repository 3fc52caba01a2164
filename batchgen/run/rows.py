"""Dataset rows as a :class:`~batchgen.io.protocols.PromptSource` (``data.format`` other than
``openai_batch``): every row is rendered by the ``prompt`` section and generated with the
``generation`` section's parameters (:func:`build_params`).

This module imports neither torch nor the engine (the parameter classes are torch-free).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, GenerationSection, RunConfig
from batchgen.io.dataset import check_columns, load_rows
from batchgen.io.prompts import PromptBuilder, iter_prompts
from batchgen.io.protocols import EngineView, Preview, PromptRecord, ResumeIndex
from batchgen.sampling.params import BeamSearchParams, SamplingParams

__all__ = ["DatasetRows", "build_params"]


def build_params(gen: GenerationSection, logits_processors: Sequence[Any] = ()) -> Any:
    """The engine parameters of a ``generation`` section: SamplingParams (greedy, sample) or
    BeamSearchParams. Raises ValueError for values the engine refuses."""
    common: dict[str, Any] = dict(
        max_tokens=gen.max_tokens,
        min_tokens=gen.min_tokens,
        stop=list(gen.stop),
        stop_token_ids=list(gen.stop_token_ids),
        ignore_eos=gen.ignore_eos,
        structured_outputs=None if gen.structured_outputs is None else gen.structured_outputs.params(),
    )
    if gen.mode == "beam":
        return BeamSearchParams(
            beam_width=gen.beam_width,
            length_penalty=gen.length_penalty,
            early_stopping=gen.early_stopping,
            **common,
        )
    sampling: dict[str, Any] = dict(
        presence_penalty=gen.presence_penalty,
        frequency_penalty=gen.frequency_penalty,
        repetition_penalty=gen.repetition_penalty,
        logprobs=gen.logprobs,
        logits_processors=list(logits_processors),
    )
    if gen.mode == "greedy":
        return SamplingParams(n=1, temperature=0.0, **sampling, **common)
    return SamplingParams(
        n=gen.n,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        min_p=gen.min_p,
        **sampling,
        **common,
    )


class DatasetRows:
    """The rows of ``data``, loaded (and checked) when built.

    Args:
        config: the job's config (``data``, ``prompt``, ``generation`` and ``metrics`` are read).
        logits_processors: the job's sampler processors, in every row's params.
        metric_columns: metric key -> the columns its ``score`` reads (checked against the data).

    Raises:
        DataError, ConfigError: the data cannot be loaded, a column is missing, or the
            ``generation`` section holds values the engine refuses.
    """

    def __init__(self, config: RunConfig, logits_processors: Sequence[Any] = (),
                 metric_columns: dict[str, Iterable[str]] | None = None) -> None:
        self.config = config
        try:
            self.params = build_params(config.generation, logits_processors)
        except ValueError as exc:  # the schema mirrors the engine's checks; this is a backstop
            raise ConfigError([ConfigIssue("generation", str(exc))]) from None
        self.data = load_rows(config.data)
        check_columns(self.data.columns, config, metric_columns)
        self.columns = self.data.columns

    def __len__(self) -> int:
        return len(self.data)

    def todo(self, answered: ResumeIndex) -> int:
        return sum(1 for i in self.data.ids if i not in answered)

    def _builder(self, tokenizer: Any, max_model_len: int | None) -> PromptBuilder:
        return PromptBuilder(self.config.prompt, tokenizer, max_model_len, self.config.generation.max_tokens)

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        builder = self._builder(engine.tokenizer, engine.max_model_len)
        for prompt in iter_prompts(self.data, builder, answered):
            if prompt.error is None:
                prompt.params = self.params
            yield prompt

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        """Render the first ``rows`` rows; a row that fails is an issue at ``prompt``."""
        builder = self._builder(tokenizer, None)
        issues = []
        shown = 0
        for position, row in enumerate(self.data.dataset):
            if shown >= rows:
                break
            shown += 1
            prompt = builder.build(self.data.ids[position], self.data.indices[position], dict(row))
            if prompt.error is not None:
                issues.append(("prompt", f"row id {prompt.id!r}: {prompt.error}"))
        checked = f"{len(self)} rows from {self.config.data.source}, template renders on the first {shown}"
        return Preview(checked, issues)
