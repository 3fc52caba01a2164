"""The run configuration: YAML in, a validated :class:`RunConfig` out.

Contract:

* YAML is read with ``yaml.safe_load`` only; the top level must be a mapping.
* ``--set a.b=value`` overrides are applied to the raw mapping before validation; the value
  is parsed with ``yaml.safe_load`` so ``--set data.limit=5`` gives an int and
  ``--set prompt.system_prompt=null`` gives ``None``.
* Every section forbids unknown keys and is strict about types: an int, a float or a bool must
  be written as one (``max_tokens: true`` or ``max_tokens: "8"`` is an error; an int is a fine
  float). Byte sizes take an int or a string such as ``"512MiB"``. Validation collects *all* problems and raises one
  :class:`ConfigError` whose :attr:`ConfigError.issues` each carry a dotted key path (the same
  spelling ``--set`` accepts, e.g. ``metrics.0.options``), a message, and, for unknown keys and
  bad choices, a did-you-mean suggestion and the valid choices.
* Plugin names and options are checked too when a plugin registry is passed (duck-typed: its
  ``resolve(kind, name)`` gives the registration a bare or ``PLUGIN:NAME`` name picks, whose
  ``spec`` has an ``options_model``, or raises a ``PluginError``). The registry
  travels in pydantic's validation context so that plugin problems are reported together with
  schema problems.

This module imports neither torch nor the engine: ``batchgen validate`` must stay cheap.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from batchgen.suggest import did_you_mean

DEFAULT_MODEL = "smollm2-135m-instruct"

GenerationMode = Literal["greedy", "sample", "beam"]
IfExists = Literal["error", "resume", "overwrite"]


# --------------------------------------------------------------------------- errors


class ConfigIssue(typing.NamedTuple):
    """One problem in a config: where (dotted key path, "" for the whole file) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A config or usage problem; the CLI prints it and exits with status 2.

    ``issues`` holds every problem found, so the user can fix them all in one go.
    """

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if len(self.issues) == 1:
            return f"{where}invalid config: {self.issues[0]}"
        lines = [f"{where}invalid config ({len(self.issues)} errors):"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


def _choices(choices: Sequence[str]) -> str:
    return ", ".join(f"'{c}'" for c in choices)


# --------------------------------------------------------------------------- schema


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
                msg = f"unknown option{did_you_mean(str(err['loc'][-1]), fields)}; valid: {_choices(fields)}"
            problems.append(f"{where}: {msg}")
        raise ValueError(f"invalid options for {noun} plugin '{name}': " + "; ".join(problems)) from None


class StructuredOutputsSection(_Section):
    """``generation.structured_outputs:`` constrain every generation; exactly one key is set.

    ``json`` takes a JSON schema as a mapping, or the path of a ``.json`` file holding one (read
    when the config is validated, relative to the working folder; the resolved config records
    the schema itself). Each constraint is compiled when the config is validated, so a bad
    schema, regex or grammar is a config error naming its key.
    """

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema: a mapping, or the path of a .json file")
    regex: str | None = Field(None, min_length=1, description="the output fully matches this regex")
    choice: list[str] | None = Field(None, min_length=1, description="the output is one of these strings")
    grammar: str | None = Field(None, min_length=1, description="an EBNF grammar (xgrammar's dialect)")
    json_object: bool = Field(False, description="true: the output is any JSON object")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, populate_by_name=True)

    @field_validator("json_", mode="after")
    @classmethod
    def _schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):
            path = Path(value)
            if not path.is_file():
                raise ValueError(f"the JSON schema file '{value}' does not exist; give a path to a "
                                 ".json file or the schema itself as a mapping")
            import json

            try:
                value = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"the JSON schema file '{path}' could not be read as JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(f"the JSON schema file '{path}' must hold a JSON object, "
                                 f"got {type(value).__name__}")
        if value is not None:
            _check_constraint("json", value)
        return value

    @field_validator("regex", "choice", "grammar", mode="after")
    @classmethod
    def _compiles(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            _check_constraint(str(info.field_name), value)
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsSection:
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object: true'"
                             + (f"; got {', '.join(repr(k) for k in given)}" if given else ""))
        return self

    @model_serializer(mode="wrap")
    def _dump_as_written(self, handler: Any) -> dict[str, Any]:
        """Dump the keys as the YAML spells them (``json``, not the field's Python name)."""
        data = handler(self)
        if isinstance(data, dict) and "json_" in data:
            data = {("json" if k == "json_" else k): v for k, v in data.items()}
        return data

    def params(self) -> Any:
        """The engine's :class:`batchgen.sampling.params.StructuredOutputsParams`."""
        from batchgen.sampling.params import StructuredOutputsParams

        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object)


def _check_constraint(kind: str, value: Any) -> None:
    """Raise ValueError unless the constraint compiles (or when xgrammar is missing)."""
    from batchgen.sampling.params import StructuredOutputsParams
    from batchgen.structured import check

    try:
        check(StructuredOutputsParams(**{kind: value}))
    except ImportError as exc:
        raise ValueError(str(exc)) from None


_SAMPLE_ONLY = ("n", "temperature", "top_p", "top_k", "min_p")
_BEAM_ONLY = ("beam_width", "length_penalty", "early_stopping")
# Per-token knobs of the sampler that beam search (which ranks by raw logprobs) does not apply.
_NOT_BEAM = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "sampler")


class GenerationSection(_Section):
    """``generation:`` greedy, n-sample parallel sampling, or beam search.

    Mode-specific keys (``n``, ``temperature``... for ``sample``; ``beam_width``,
    ``length_penalty``, ``early_stopping`` for ``beam``) given with a non-default value are
    rejected in the other modes, so that a wrong mode never silently ignores them.
    """

    mode: GenerationMode = "greedy"
    max_tokens: PositiveInt = 64
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logprobs: NonNegativeInt | None = None
    # sample
    n: PositiveInt = 1
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    min_p: float = Field(0.0, ge=0, le=1)
    # beam
    beam_width: PositiveInt = 4
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    sampler: SamplerRef | None = None
    structured_outputs: StructuredOutputsSection | None = None

    @model_validator(mode="after")
    def _mode_keys(self) -> GenerationSection:
        # A key counts as used when it was given with a non-default value; defaults are fine so
        # that a dumped (fully resolved) config loads again.
        def used(key: str) -> bool:
            return key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default

        wrong = []
        if self.mode != "sample":
            wrong += [k for k in _SAMPLE_ONLY if used(k)]
        if self.mode != "beam":
            wrong += [k for k in _BEAM_ONLY if used(k)]
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.structured_outputs is not None and (used("min_tokens") or used("ignore_eos")):
            raise ValueError("'structured_outputs' decides where the output ends: drop "
                             + " and ".join(repr(k) for k in ("min_tokens", "ignore_eos") if used(k)))
        if self.mode == "beam":
            unsupported = [k for k in _NOT_BEAM if used(k)]
            if unsupported:
                raise ValueError(
                    "beam search does not support " + ", ".join(f"'{k}'" for k in unsupported)
                    + "; use mode 'sample' or 'greedy' for them"
                )
        if wrong:
            owner = {k: "sample" for k in _SAMPLE_ONLY} | {k: "beam" for k in _BEAM_ONLY}
            parts = [f"'{k}' applies to mode '{owner[k]}'" for k in wrong]
            raise ValueError(f"with mode '{self.mode}': " + ", ".join(parts))
        return self

    @property
    def num_outputs(self) -> int:
        """How many generations each record gets."""
        return {"greedy": 1, "sample": self.n, "beam": self.beam_width}[self.mode]


class EngineSection(_Section):
    """``engine:`` the paged KV cache and scheduler knobs, passed to :class:`batchgen.LLM`."""

    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block (1..256)")
    kv_cache_memory: ByteSize | None = Field(
        None, gt=0, description="bytes, or a string like '512MiB'; null = the engine's default"
    )
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["prefix", "fcfs"] = Field(
        "prefix", description="order of waiting rows: 'prefix' runs rows that share a prompt prefix "
        "together (computed once); 'fcfs' keeps dataset order"
    )
    attention_backend: Literal["auto", "torch", "cpu", "cuda"] = "auto"
    linear_backend: Literal["auto", "torch", "cpu"] = Field(
        "auto", description="'cpu': the model's linear layers through batchgen's C GEMM; "
        "'auto' = 'cpu' on the CPU wherever it builds, else 'torch'"
    )
    num_threads: Literal["auto"] | PositiveInt = Field(
        "auto", description="CPU threads: 'auto' = OMP_NUM_THREADS if set, else the CPUs "
        "this process may use (affinity, cgroup quota)"
    )
    seed: int = Field(
        0, description="each record's sampling seed derives from it and the record id, so reruns and resumes repeat"
    )
    index_checks: bool = Field(
        True, description="the cuda attention backend checks context lengths, block ids and slots "
        "against the KV cache before launching (one host sync per step); false skips it"
    )


class ResourcesSection(_Section):
    """``executor.resources_per_replica:`` what Ray reserves for each engine replica."""

    num_cpus: float | None = Field(
        None, gt=0, description="CPU cores per replica, also its torch threads on the CPU; null = 1"
    )
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per replica; null = 1 on a cluster with GPUs, else 0"
    )


class ExecutorSection(_Section):
    """``executor:`` where the engine runs: in this process, or as replicas on a Ray cluster.

    See docs/scale-out.md. The Ray backend needs the ``ray`` extra (checked by
    :func:`batchgen.executor.check_executor`, not here: this module imports no optional package).
    """

    backend: Literal["local", "ray"] = "local"
    replicas: PositiveInt | Literal["auto"] = Field(
        1, description="engine replicas; 'auto' = one per GPU on a GPU cluster, else one per num_cpus cores"
    )
    address: str | None = Field(
        None, description="null = start a local Ray; 'auto' = join the cluster of this machine; "
        "'ray://host:port' (Ray Client) or 'host:port' (the head's GCS) = join that cluster"
    )
    resources_per_replica: ResourcesSection = Field(default_factory=ResourcesSection)

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas(cls, value: Any) -> Any:
        # One clear message instead of pydantic's two (int parsing + literal) for the union.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected a positive integer or 'auto', got {value!r}")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        rest = value[len("ray://"):] if value.startswith("ray://") else value
        host, sep, port = rest.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"invalid Ray address {value!r}; use null (start a local Ray), 'auto', "
                "'ray://host:port' (Ray Client, port 10001 by default) or 'host:port' (the head's GCS, port 6379)"
            )
        return value

    @model_validator(mode="after")
    def _local_is_one(self) -> ExecutorSection:
        if self.backend == "local":
            extra = [k for k in ("replicas", "address") if k in self.model_fields_set and getattr(self, k) not in (1, None)]
            if extra:
                keys = " and ".join(f"'{k}'" for k in extra)
                verb = "needs" if len(extra) == 1 else "need"
                raise ValueError(f"{keys} {verb} backend 'ray' (the local backend runs one engine in this process); "
                                 "set executor.backend: ray")
        return self


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


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value`` into (``["a", "b"]``, value parsed as YAML).

    Raises :class:`ConfigError` for text without ``=`` or with an empty key.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError([ConfigIssue("--set", f"expected KEY.PATH=VALUE, got '{text}'")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(key, f"--set value is not valid YAML: {exc}")]) from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override applied.

    Missing mappings on the way are created; a numeric part indexes into an existing list
    (``metrics.0.name=contains``). Unknown keys are left for the schema to reject, so they get
    the same did-you-mean as keys in the file.
    """
    import copy

    result = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = result
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        [ConfigIssue(where, f"--set: no list item {part} (the list has {len(node)})")]
                    )
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            else:
                parent = ".".join(parts[:i])
                raise ConfigError([ConfigIssue(where, f"--set: '{parent}' is not a mapping")])
    return result


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping safely; problems raise :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", f"config file not found: {path}")]) from None
    except OSError as exc:
        raise ConfigError([ConfigIssue("", f"cannot read config file {path}: {exc.strerror}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue("", f"YAML syntax error{where}: {problem}")], str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue("", f"the top level must be a mapping of sections, got {type(data).__name__}")],
            str(path),
        )
    return data


def validate_config(data: Mapping[str, Any], registry: Any = None, source: str | None = None) -> RunConfig:
    """Validate a raw mapping into a :class:`RunConfig`, raising one :class:`ConfigError` with all issues."""
    try:
        return RunConfig.model_validate(dict(data), context={"registry": registry})
    except ValidationError as exc:
        raise ConfigError([_issue(err) for err in exc.errors()], source) from None


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    registry: Any = None,
) -> RunConfig:
    """Read ``path``, apply ``--set`` overrides and validate (plugins too, given a registry)."""
    data = apply_overrides(read_yaml(path), overrides)
    return validate_config(data, registry=registry, source=str(path))


def plugin_modules(path: str | Path, overrides: Sequence[str] = ()) -> list[str]:
    """The ``plugins:`` list of a config, read before full validation.

    The registry must be built (importing these modules) before plugin names can be checked,
    so this peeks at the raw list. A malformed value yields ``[]``; full validation reports it.
    """
    data = apply_overrides(read_yaml(path), overrides)
    modules = data.get("plugins")
    if isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        return list(modules)
    return []


# --------------------------------------------------------------------------- error rendering


def _unwrap_model(annotation: Any) -> Any:
    """The pydantic model (or Literal) inside Optional[...] / list[...] / dict[...] wrappers."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, dict, Sequence):
        for arg in typing.get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
        return None
    if origin is Literal:
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _walk(loc: Sequence[Any]) -> Any:
    """Follow a pydantic error location from RunConfig; return the model/Literal found there."""
    node: Any = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return None
        field = node.model_fields.get(part)
        if field is None:
            return None
        node = _unwrap_model(field.annotation)
    return node


#: Strict type errors -> what the key takes, in YAML's words.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "text",
}


def _yaml_text(value: Any) -> str:
    """``value`` as it reads in YAML: true, null, 8, 'text'."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return str(value)


def _type_message(kind: str, value: Any) -> str:
    """``expected an integer, got true`` plus the fix when it is obvious."""
    message = f"expected {_EXPECTED[kind]}, got {_yaml_text(value)}"
    if isinstance(value, str) and kind != "string_type":
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = None
        if kind == "bool_type" and isinstance(parsed, bool):
            return message + f"; write {_yaml_text(parsed)} without quotes"
        if kind in ("int_type", "float_type") and isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
            if kind == "float_type" or isinstance(parsed, int):
                return message + f"; write {parsed} without quotes"
    if kind == "int_type" and isinstance(value, float) and value.is_integer():
        return message + f"; write {int(value)}"
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return message + "; a boolean is not a number"
    if kind == "string_type" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return message + f"; quote it: '{value}'"
    return message


def _issue(err: Mapping[str, Any]) -> ConfigIssue:
    """Turn one pydantic error into a :class:`ConfigIssue` with a friendlier message."""
    # Pydantic adds the name of a model-validator step ('function-after[...]') to some locations.
    loc = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        parent = _walk(loc[:-1])
        valid = [f.alias or k for k, f in parent.model_fields.items()] if parent is not None else []
        message = f"unknown key{did_you_mean(str(loc[-1]), valid)}"
        if valid:
            message += f"; valid keys here: {_choices(valid)}"
        return ConfigIssue(path, message)
    if kind == "missing":
        return ConfigIssue(path, "required key is missing")
    if kind == "literal_error":
        literal = _walk(loc)
        choices = [str(c) for c in typing.get_args(literal)] if literal is not None else []
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return ConfigIssue(path, f"invalid value {value!r}{hint}; valid: {_choices(choices)}")
    if kind == "value_error":
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        return ConfigIssue(path, message)
    if kind in _EXPECTED:
        return ConfigIssue(path, _type_message(kind, value))
    message = err["msg"]
    if not isinstance(value, (dict, list)) or kind.endswith("_type"):
        shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
        message += f" (got {shown})"
    return ConfigIssue(path, message)


def resolved_dict(config: RunConfig, registry: Any = None) -> dict[str, Any]:
    """The fully resolved config (defaults filled in) as plain JSON-able data.

    With a plugin registry (duck-typed as in :func:`validate_config`), plugin options get their
    defaults filled in too, and each metric's ``label`` is set to the key its scores live under.
    """
    data = config.model_dump(mode="json")
    for ref, dumped in zip(config.metrics, data["metrics"]):
        dumped["label"] = ref.key
        dumped["options"] = _resolved_options(registry, "metric", ref.name, ref.options)
    sampler = config.generation.sampler
    if sampler is not None:
        data["generation"]["sampler"]["options"] = _resolved_options(registry, "sampler", sampler.name, sampler.options)
    return data


def _resolved_options(registry: Any, kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A plugin's options with its defaults filled in, or as given when that is not possible."""
    if registry is None:
        return dict(options)
    from batchgen.plugins.errors import PluginError

    try:
        return registry.resolve(kind, name).spec.options_model.model_validate(options).model_dump(mode="json")
    except (PluginError, ValidationError, TypeError, ValueError):
        return dict(options)
