"""The plain sections of a run config: ``model``, ``data``, ``prompt``, ``output``, and the
plugin references (``generation.sampler``, ``metrics``) checked against the registry in the
validation context. Every section forbids unknown keys and is strict about types.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator, model_validator

from batchgen.config.errors import quoted
from batchgen.suggest import did_you_mean

DEFAULT_MODEL = "smollm2-135m-instruct"

IfExists = Literal["error", "resume", "overwrite"]


class _Section(BaseModel):
    """Base for every section: unknown keys are errors, types are strict (no ``true`` -> 1, no
    ``"8"`` -> 8), values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ModelSection(_Section):
    """``model:`` which weights to run and how."""

    name: str = Field(DEFAULT_MODEL, min_length=1, description="model name, alias or local HF folder")
    aliases: list[str] = Field(
        default_factory=list,
        description="other names the 'model' field of an OpenAI batch line may give for this model",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    adapters: dict[str, str] | str | None = Field(
        None, description="LoRA adapters (PEFT folders): a map of names to folders, or a glob of checkpoint "
        "folders (each named by its folder); generation.adapters picks which run (docs/lora.md)")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        head, _, index = value.partition(":")
        if head in ("auto", "cpu") and not index:
            return value
        if head == "cuda" and (not index or index.isdigit()):
            return value
        raise ValueError(
            f"unknown device '{value}'{did_you_mean(value, ['auto', 'cpu', 'cuda'])}; "
            "valid: 'auto', 'cpu', 'cuda' or 'cuda:N'"
        )


class DataSection(_Section):
    """``data:`` where the prompts come from (anything HF ``datasets`` can load)."""

    source: str = Field(
        min_length=1,
        description=(
            "a local json/jsonl/csv/parquet/txt file or folder, a save_to_disk folder, "
            "'package:<pkg>/<file>' for a file shipped inside an installed package, or a hub name"
        ),
    )
    format: Literal["auto", "json", "csv", "parquet", "text", "arrow", "openai_batch"] = Field(
        "auto", description="'openai_batch': an OpenAI Batch API input file, streamed line by line"
    )
    name: str | None = Field(None, description="hub dataset configuration (subset) name")
    split: str = "train"
    limit: PositiveInt | None = None
    shuffle: bool = False
    seed: int = 0
    id_column: str | None = Field(None, description="column holding a unique id; default: the row index")


class PromptSection(_Section):
    """``prompt:`` how a dataset row becomes the model's input."""

    column: str | None = Field(None, description="take the prompt from this column (default 'prompt')")
    template: str | None = Field(None, description="Jinja template over the row's columns")
    chat_template: bool | None = Field(
        None, description="wrap in the model's chat template; null = when the tokenizer has one"
    )
    system_prompt: str | None = None
    max_prompt_tokens: PositiveInt | None = Field(
        None, description="rows whose prompt is longer become error records"
    )

    @model_validator(mode="after")
    def _one_source(self) -> PromptSection:
        if self.column is not None and self.template is not None:
            raise ValueError("set either 'column' or 'template', not both")
        if self.template is not None:
            # deferred: jinja2 (~0.1 s) only for a template
            # Syntax errors surface at load time (with a line number), not once per row.
            import jinja2
            from jinja2.sandbox import SandboxedEnvironment

            try:
                SandboxedEnvironment(undefined=jinja2.StrictUndefined).parse(self.template)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"template syntax error on line {exc.lineno}: {exc.message}") from None
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError("'system_prompt' needs the chat template; drop it or set chat_template: true")
        return self

    @property
    def prompt_column(self) -> str | None:
        """The column the prompt is read from, or None when a template renders it."""
        if self.template is not None:
            return None
        return self.column if self.column is not None else "prompt"


class PluginRef(_Section):
    """A reference to a plugin by name, with its options (checked by the plugin's schema)."""

    name: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)


class SamplerRef(PluginRef):
    """``generation.sampler:`` a sampler plugin contributing a logits processor."""

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> SamplerRef:
        _check_plugin(info, "sampler", self.name, self.options)
        return self


class MetricRef(PluginRef):
    """One entry of ``metrics:``; ``label`` keys its scores (default: the plugin name)."""

    label: str | None = Field(None, min_length=1)

    @property
    def key(self) -> str:
        """Where this metric's scores live in a record's ``metrics`` and in the summary."""
        return self.label or self.name

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> MetricRef:
        _check_plugin(info, "metric", self.name, self.options)
        return self


def _check_plugin(info: ValidationInfo, noun: str, name: str, options: dict[str, Any]) -> None:
    """Check a plugin name and options against the registry in the validation context.

    The registry's ``resolve(noun, name)`` decides what a bare or qualified name picks, and
    raises (a :class:`~batchgen.plugins.PluginError`) for a name that is unknown or that two
    plugins register. Without a registry (plain schema checks) this does nothing.
    """
    registry = (info.context or {}).get("registry")
    if registry is None:
        return
    # deferred: the plugins package (pluggy, the built-ins; ~0.5 s) only with a registry
    from batchgen.plugins.errors import PluginError

    try:
        spec = registry.resolve(noun, name).spec
    except PluginError as exc:
        raise ValueError(str(exc)) from None
    options_model = spec.options_model
    try:
        options_model.model_validate(options)
    except ValidationError as exc:
        fields = list(options_model.model_fields)
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "options"
            msg = err["msg"]
            if err["type"] == "extra_forbidden" and err["loc"]:
                msg = f"unknown option{did_you_mean(str(err['loc'][-1]), fields)}; valid: {quoted(fields)}"
            problems.append(f"{where}: {msg}")
        raise ValueError(f"invalid options for {noun} plugin '{name}': " + "; ".join(problems)) from None


class OutputSection(_Section):
    """``output:`` the JSONL file, its summary, and what to do when it already exists."""

    path: str = Field(min_length=1)
    if_exists: IfExists = Field(
        "error", description="'error' (stop), 'resume' (skip ids already written) or 'overwrite'"
    )
    summary_path: str | None = Field(None, description="default: <path without .jsonl>.summary.json")
    format: Literal["auto", "jsonl", "openai_batch"] = Field(
        "auto", description="'jsonl' (batchgen records) or 'openai_batch' (OpenAI Batch API output lines); "
        "'auto' = 'openai_batch' when data.format is 'openai_batch', else 'jsonl'"
    )
    error_path: str | None = Field(None, description="failed records go to this file instead of 'path'")

    @property
    def summary_file(self) -> Path:
        """Where the run summary goes."""
        if self.summary_path:
            return Path(self.summary_path)
        path = Path(self.path)
        stem = path.name[: -len(path.suffix)] if path.suffix else path.name
        return path.with_name(f"{stem}.summary.json")
