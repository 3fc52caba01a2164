"""``RunConfig``: the whole run, one YAML file, and the rules that tie its sections together.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from batchgen.config.engine import EngineSection, ExecutorSection
from batchgen.config.generation import GenerationSection
from batchgen.config.sections import DataSection, MetricRef, ModelSection, OutputSection, PromptSection, _Section


def _explicit(section: BaseModel) -> set[str]:
    """Keys of ``section`` given with a non-default value."""
    fields = type(section).model_fields
    return {k for k in section.model_fields_set if getattr(section, k) != fields[k].get_default(call_default_factory=True)}


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
    def _openai_batch(self) -> RunConfig:
        """Resolve ``output.format: auto`` and reject keys an OpenAI batch file makes meaningless."""
        if self.output.format == "auto":
            self.output.format = "openai_batch" if self.data.format == "openai_batch" else "jsonl"
        problems = []
        if self.data.format == "openai_batch":
            # Each line carries its own prompt and generation parameters.
            given = [f"data.{k}" for k in sorted(_explicit(self.data)) if k not in ("source", "format", "limit")]
            given += [f"prompt.{k}" for k in sorted(_explicit(self.prompt))]
            given += [f"generation.{k}" for k in sorted(_explicit(self.generation)) if k != "sampler"]
            if given:
                problems.append(
                    "with data.format 'openai_batch' each line carries its own prompt and generation "
                    f"parameters; drop {', '.join(repr(k) for k in given)}"
                )
        elif self.model.aliases:
            problems.append("'model.aliases' applies to data.format 'openai_batch' only")
        if self.output.format == "openai_batch" and self.metrics:
            problems.append("metrics score batchgen records; with output.format 'openai_batch' drop 'metrics' "
                            "or write output.format 'jsonl'")
        if self.output.error_path is not None and Path(self.output.error_path) == Path(self.output.path):
            problems.append("'output.error_path' must differ from 'output.path'")
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
