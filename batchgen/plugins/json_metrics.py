"""The JSON metrics of the built-ins (registered with them in
:mod:`batchgen.plugins.builtin_metrics`), and the JSON parsing and schema loading they share:

* ``json_valid``: a generation is one JSON value (strict JSON: no ``NaN`` or ``Infinity``);
* ``json_schema_valid``: a generation is JSON that the job's JSON schema (its
  ``generation.structured_outputs.json``), or the schema given in the options, accepts; checked
  with the ``jsonschema`` library (``pip install 'batchgen[structured]'``).

Both score every generation of a record and report ``first``, ``any`` and ``mean``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchgen.metrics import Scores, first_any_mean, generation_texts, mean_aggregate

__all__ = ["STRUCTURED_EXTRA", "JsonSchemaValid", "JsonSchemaValidOptions", "JsonValid", "JsonValidOptions",
           "load_schema", "parse_json", "schema_validator"]


#: One Markdown code block around the whole text: ```json ... ``` (the language tag is optional).
_CODE_FENCE = re.compile(r"\A\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*\Z", re.DOTALL)
STRUCTURED_EXTRA = "pip install 'batchgen[structured]'"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str, allow_code_fence: bool = False) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` is one strict JSON value, else ``(False, None)``.

    Whitespace around the value is allowed (JSON allows it); Python's extensions ``NaN``,
    ``Infinity`` and ``-Infinity`` are not. With ``allow_code_fence`` a text that is one Markdown
    code block (```json ... ```) is judged by the block's content.
    """
    if allow_code_fence:
        fenced = _CODE_FENCE.match(text)
        if fenced:
            text = fenced.group(1)
    try:
        return True, json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return False, None


def _jsonschema() -> Any:
    """The ``jsonschema`` module, or an ImportError naming the extra to install."""
    try:
        # deferred: jsonschema (~0.3 s) only for json_valid with a schema
        import jsonschema
    except ImportError:
        raise ImportError(f"json_schema_valid needs the jsonschema library: {STRUCTURED_EXTRA}") from None
    return jsonschema


def load_schema(value: Mapping[str, Any] | str) -> dict[str, Any]:
    """A JSON schema given as a mapping, as JSON text (``"{...}"``) or as a path to a ``.json`` file.

    A relative path is relative to the working directory, like every path in a config.

    Raises:
        ValueError: the file is missing or unreadable, is not JSON, or does not hold an object.
    """
    if isinstance(value, Mapping):
        return dict(value)
    if value.lstrip().startswith("{"):
        where, text = "the schema text", value
    else:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"schema file '{value}' does not exist (relative paths are relative to the working "
                             "directory)")
        where = f"schema file '{value}'"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where} cannot be read: {exc}") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must hold a JSON object (a schema), got {type(schema).__name__}")
    return schema


def schema_validator(value: Mapping[str, Any] | str) -> Any:
    """A ``jsonschema`` validator for the schema ``value`` (see :func:`load_schema`), of the draft
    the schema names in ``$schema`` (else the latest).

    Raises:
        ValueError: as :func:`load_schema`, or the schema breaks its draft's meta-schema.
        ImportError: jsonschema is not installed (naming the extra).
    """
    schema = load_schema(value)
    jsonschema = _jsonschema()
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON schema: {exc.message}" + (f" (at '{where}')" if where else "")) from None
    return cls(schema)


class JsonValidOptions(BaseModel):
    """Options of ``json_valid``."""

    model_config = ConfigDict(extra="forbid")

    allow_code_fence: bool = Field(
        False, description="Also accept a generation that is one Markdown code block (```json ... ```) around the JSON."
    )


class JsonValid:
    """Per generation 1.0 when its text is one strict JSON value, else 0.0; first/any/mean."""

    name = "json_valid"
    required_columns: tuple[str, ...] = ()

    def __init__(self, options: JsonValidOptions) -> None:
        self.options = options

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        return first_any_mean([parse_json(t, self.options.allow_code_fence)[0] for t in generation_texts(record)])

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        return mean_aggregate(scores, keys=("first", "any", "mean"))


with warnings.catch_warnings():
    # The option is called ``schema`` in configs; it shadows pydantic's deprecated
    # ``BaseModel.schema()`` classmethod, which nothing here uses.
    warnings.filterwarnings("ignore", message='Field name "schema"', category=UserWarning)

    class JsonSchemaValidOptions(JsonValidOptions):
        """Options of ``json_schema_valid``."""

        schema: dict[str, Any] | str | None = Field(
            None,
            description="The JSON schema (a mapping, or a path to a .json file); "
            "default: the job's generation.structured_outputs.json.",
        )

        @field_validator("schema")
        @classmethod
        def _valid_schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
            if value is not None:
                try:
                    schema_validator(value)
                except ImportError as exc:
                    raise ValueError(str(exc)) from None
            return value  # kept as given (a path stays a path in the resolved config)


class JsonSchemaValid:
    """Per generation 1.0 when its text is strict JSON that the schema accepts, else 0.0.

    The schema is the ``schema`` option, else the job's ``generation.structured_outputs.json``,
    found by :meth:`configure` when the job is planned.
    """

    name = "json_schema_valid"
    required_columns: tuple[str, ...] = ()

    def __init__(self, options: JsonSchemaValidOptions) -> None:
        self.options = options
        self._validator: Any = schema_validator(options.schema) if options.schema is not None else None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Without a ``schema`` option, take the job's ``generation.structured_outputs.json``.

        Raises:
            ValueError: neither is set, or the job's schema cannot be loaded.
        """
        if self.options.schema is not None:
            return
        structured = (config.get("generation") or {}).get("structured_outputs") or {}
        schema = structured.get("json") if isinstance(structured, Mapping) else None
        if schema is None:
            raise ValueError(
                "no JSON schema to check against: set generation.structured_outputs.json, or give the "
                "metric one in options.schema (a schema mapping or a path to a .json file)"
            )
        try:
            self._validator = schema_validator(schema)
        except ImportError as exc:
            raise ValueError(str(exc)) from None

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        if self._validator is None:
            raise RuntimeError("no JSON schema: pass options.schema, or configure() with a job that has "
                               "generation.structured_outputs.json")
        flags = []
        for text in generation_texts(record):
            ok, value = parse_json(text, self.options.allow_code_fence)
            flags.append(ok and self._validator.is_valid(value))
        return first_any_mean(flags)

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        return mean_aggregate(scores, keys=("first", "any", "mean"))
