"""``generation:`` the decoding mode and its knobs, and ``generation.structured_outputs``.

This module imports neither torch nor the engine (a constraint is compiled through
:mod:`batchgen.structured`, which imports its grammar library lazily).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationInfo, field_validator, model_serializer, model_validator

from batchgen.config.formats import SCORING_KINDS, scoring_kind
from batchgen.config.sections import SamplerRef, _Section
from batchgen.sampling.params import StructuredOutputsParams

#: The decoding modes, then the scoring modes (each a kind of :data:`SCORING_KINDS`; a
#: section's kind is :func:`~batchgen.config.formats.scoring_kind`).
GenerationMode = Literal["greedy", "sample", "beam", "loglikelihood", "perplexity"]


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
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object)


def _check_constraint(kind: str, value: Any) -> None:
    """Raise ValueError unless the constraint compiles and some output can match it (as far
    as a cheap bounded search can tell), or when xgrammar is missing."""
    # deferred: batchgen.structured (~0.1 s) only when a constraint is configured
    from batchgen.structured import check, satisfiable

    params = StructuredOutputsParams(**{kind: value})
    try:
        check(params)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    if satisfiable(params) is False:
        raise ValueError(f"no output can match this {'JSON schema' if kind == 'json' else kind}: it compiles, but "
                         "it allows no text at all, so every row would fail")


_SAMPLE_ONLY = ("n", "temperature", "top_p", "top_k", "min_p")
_BEAM_ONLY = ("beam_width", "length_penalty", "early_stopping")
# Per-token knobs of the sampler that beam search (which ranks by raw logprobs) does not apply.
_NOT_BEAM = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "sampler")
# The decoding keys that a scoring job has no use for (the keys only one scoring kind reads are
# that kind's ``keys``).
_NOT_SCORING = ("max_tokens", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logprobs", "sampler", "structured_outputs")


class GenerationSection(_Section):
    """``generation:`` greedy, n-sample parallel sampling, or beam search; or, scoring given text
    instead of generating, ``loglikelihood`` (each row's ``choices`` given its prompt) and
    ``perplexity`` (each row's prompt text, in rolling windows).

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
    # loglikelihood
    choices: str | list[str] | None = Field(
        None, description="the choices to score: a column holding a list of texts, or a list of Jinja templates")
    answer: str | None = Field(
        None, min_length=1, description="column holding the answer: the index of the right choice, or its text")
    target_delimiter: str = Field(" ", description="put before every choice (lm-eval's target_delimiter)")
    truncate: bool = Field(False, description="drop a too-long context's first tokens instead of an error record")
    adapters: list[str] | None = Field(
        None, min_length=1, description="run every row under each of these LoRA adapters of model.adapters "
        "('base': the model without one), in one run; default: every adapter of model.adapters")

    @model_validator(mode="after")
    def _mode_keys(self) -> GenerationSection:
        # A key counts as used when it was given with a non-default value; defaults are fine so
        # that a dumped (fully resolved) config loads again.
        def used(key: str) -> bool:
            field = type(self).model_fields[key]  # get_default: a default_factory's value ([] for stop)
            return key in self.model_fields_set and getattr(self, key) != field.get_default(call_default_factory=True)

        wrong = []
        if self.mode != "sample":
            wrong += [k for k in _SAMPLE_ONLY if used(k)]
        if self.mode != "beam":
            wrong += [k for k in _BEAM_ONLY if used(k)]
        kind = scoring_kind(self)
        owner = {k: "sample" for k in _SAMPLE_ONLY} | {k: "beam" for k in _BEAM_ONLY}
        for other in SCORING_KINDS.values():
            owner |= {k: other.mode for k in other.keys}
            if other is not kind:
                wrong += [k for k in other.keys if used(k)]
        if kind is not None:
            unused = [k for k in _NOT_SCORING if used(k)]
            if unused:
                raise ValueError(f"mode '{self.mode}' scores given text and generates nothing: drop "
                                 + ", ".join(f"'{k}'" for k in unused))
            problems = kind.config_issues(self)
            if problems:
                raise ValueError("; ".join(problems))
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
            parts = [f"'{k}' applies to mode '{owner[k]}'" for k in wrong]
            raise ValueError(f"with mode '{self.mode}': " + ", ".join(parts))
        return self

    @property
    def num_outputs(self) -> int:
        """How many generations each record gets (none in a scoring mode)."""
        return {"greedy": 1, "sample": self.n, "beam": self.beam_width}.get(self.mode, 0)
