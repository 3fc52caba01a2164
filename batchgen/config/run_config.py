"""``RunConfig``: the whole run, one YAML file, and the rules that tie its sections together
(those of its file formats are the formats' own: :mod:`batchgen.config.formats`).

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from batchgen.config.engine_section import EngineSection, ExecutorSection
from batchgen.config.formats import kinds
from batchgen.config.generation import GenerationSection
from batchgen.config.sections import DataSection, MetricRef, ModelSection, OutputSection, PromptSection, _Section


class RunConfig(_Section):
    """The whole run: one YAML file."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    prompt: PromptSection = Field(default_factory=PromptSection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    executor: ExecutorSection = Field(default_factory=ExecutorSection)
    metrics: list[MetricRef] = Field(default_factory=list)
    output: OutputSection
    plugins: list[str] = Field(default_factory=list, description="extra plugin modules to import")

    @model_validator(mode="after")
    def _formats(self) -> RunConfig:
        """Resolve ``output.format: auto`` and apply the config rules of the picked source and
        record format (:func:`batchgen.config.formats.kinds`), then the output's own."""
        source, records = kinds(self)
        self.output.format = records.name  # 'auto' resolved
        problems = source.config_issues(self) + records.config_issues(self)
        if self.output.error_path is not None and Path(self.output.error_path) == Path(self.output.path):
            problems.append("'output.error_path' must differ from 'output.path'")
        logprobs, cap = self.generation.logprobs, self.engine.max_logprobs
        if logprobs is not None and 0 <= cap < logprobs:
            problems.append(f"'generation.logprobs' is {logprobs}, more than 'engine.max_logprobs' ({cap}); "
                            "ask for fewer, or raise engine.max_logprobs (-1: no cap)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @field_validator("metrics")
    @classmethod
    def _unique_labels(cls, metrics: list[MetricRef]) -> list[MetricRef]:
        seen: set[str] = set()
        for metric in metrics:
            if metric.key in seen:
                raise ValueError(f"two metrics are keyed '{metric.key}'; give one a distinct 'label'")
            seen.add(metric.key)
        return metrics
