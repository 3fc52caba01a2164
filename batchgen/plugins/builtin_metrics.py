"""batchgen's built-in metrics, registered through the public hooks like any plugin's.

* ``exact_match``: a generation equals the reference after normalisation.
* ``contains``: the normalised reference occurs in the normalised generation.
* ``regex_match``: extract an answer with a regex (GSM8K's ``#### 42`` by default, else the last
  number), from the generation and from the reference, and compare them, numerically when both
  are numbers.
* ``length``: generated token and character counts, and how often the length limit was hit.
* ``json_valid``: a generation is one JSON value (strict JSON: no ``NaN`` or ``Infinity``).
* ``json_schema_valid``: a generation is JSON that the job's JSON schema (its
  ``generation.structured_outputs.json``), or the schema given in the options, accepts; checked
  with the ``jsonschema`` library (``pip install 'batchgen[structured]'``).

The match and JSON metrics score every generation of a record and report ``first`` (generation 0: the
greedy answer or the best beam), ``any`` (some generation matched; the pass@n view) and ``mean``
(the fraction that matched). A reference column may hold one answer or a list of accepted
answers; a generation matches if it matches any of them.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchgen.metrics import Scores, distribution_stats, first_any_mean, generation_texts, mean_aggregate
from batchgen.plugins.hookspecs import hookimpl
from batchgen.plugins.scoring_metrics import scoring_metric_specs
from batchgen.plugins.specs import MetricSpec

_ARTICLES = re.compile(r"\b(a|an|the)\b")
#: A number as written in prose or GSM8K answers: optional sign and currency, thousands commas.
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
#: GSM8K's final-answer line: ``#### 42``.
GSM8K_ANSWER = r"####\s*([^\n]+)"


class Normalization(BaseModel):
    """Text normalisation shared by the match metrics; applied to generations and references."""

    model_config = ConfigDict(extra="forbid")

    lowercase: bool = Field(True, description="Compare case-insensitively.")
    strip: bool = Field(True, description="Remove leading and trailing whitespace.")
    strip_punctuation: bool = Field(False, description="Remove Unicode punctuation characters.")
    remove_articles: bool = Field(False, description="Remove the English articles a, an, the (after lowercasing).")
    collapse_whitespace: bool = Field(True, description="Turn every run of whitespace into one space.")

    def normalize(self, text: str) -> str:
        """Apply the enabled steps in a fixed order: case, punctuation, articles, whitespace."""
        if self.lowercase:
            text = text.lower()
        if self.strip_punctuation:
            text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
        if self.remove_articles:
            text = _ARTICLES.sub(" ", text)
        if self.collapse_whitespace:
            text = " ".join(text.split()) if self.strip else re.sub(r"\s+", " ", text)
        if self.strip:
            text = text.strip()
        return text


class ReferenceOptions(Normalization):
    """Options of ``exact_match`` and ``contains``."""

    reference: str = Field("answer", min_length=1, description="Dataset column holding the reference answer(s).")


def references(row: Mapping[str, Any], column: str) -> list[str]:
    """The reference answers in ``row[column]``: one value, or each item of a list.

    Raises:
        KeyError: the row has no such column (the message lists the columns it has).
    """
    if column not in row:
        raise KeyError(f"the row has no column '{column}' (columns: {', '.join(map(str, row))})")
    value = row[column]
    items = value if isinstance(value, (list, tuple)) else [value]
    return [str(item) for item in items if item is not None]


class _MatchMetric:
    """Shared scoring loop: ``matches(generation, references)`` per generation → first/any/mean."""

    name: str
    options: ReferenceOptions

    @property
    def required_columns(self) -> tuple[str, ...]:
        return (self.options.reference,)

    def matches(self, text: str, refs: Sequence[str]) -> bool:
        raise NotImplementedError

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        refs = [self.options.normalize(r) for r in references(row, self.options.reference)]
        texts = [self.options.normalize(t) for t in generation_texts(record)]
        return first_any_mean([self.matches(t, refs) for t in texts])

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        return mean_aggregate(scores, keys=("first", "any", "mean"))


class ExactMatch(_MatchMetric):
    """A generation matches when it equals one of the references after normalisation."""

    name = "exact_match"

    def __init__(self, options: ReferenceOptions) -> None:
        self.options = options

    def matches(self, text: str, refs: Sequence[str]) -> bool:
        return text in refs


class Contains(_MatchMetric):
    """A generation matches when a non-empty normalised reference occurs inside it."""

    name = "contains"

    def __init__(self, options: ReferenceOptions) -> None:
        self.options = options

    def matches(self, text: str, refs: Sequence[str]) -> bool:
        # An empty reference would be "contained" in everything; it matches nothing instead.
        return any(ref and ref in text for ref in refs)


class RegexMatchOptions(ReferenceOptions):
    """Options of ``regex_match``."""

    pattern: str = Field(
        GSM8K_ANSWER,
        description="Regex that finds the answer; its first group (else the whole match) is the answer.",
    )
    occurrence: Literal["last", "first"] = Field("last", description="Which match of the pattern to use.")
    fallback: Literal["last_number", "none"] = Field(
        "last_number", description="What to extract when the pattern does not match."
    )
    extract_reference: bool = Field(
        True, description="Extract from the reference the same way; a reference with no match is used whole."
    )
    numeric: bool = Field(True, description="Compare as numbers when both answers are numbers (72.0 == 72).")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
        return value


def parse_number(text: str) -> float | None:
    """``"$1,234.50."`` → 1234.5; None when ``text`` is not a single number."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        number = float(cleaned)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def leading_number(text: str) -> float | None:
    """``text`` as a number when it is one, else its first number (``"72 clips"`` → 72), else None."""
    number = parse_number(text)
    if number is None:
        found = NUMBER.search(text)
        number = parse_number(found.group(0)) if found else None
    return number


class RegexMatch:
    """Extract-then-compare, GSM8K-style by default."""

    name = "regex_match"

    def __init__(self, options: RegexMatchOptions) -> None:
        self.options = options
        self._pattern = re.compile(options.pattern)

    @property
    def required_columns(self) -> tuple[str, ...]:
        return (self.options.reference,)

    def extract(self, text: str) -> str | None:
        """The answer in ``text``: the pattern's chosen match, else the fallback, else None."""
        found = list(self._pattern.finditer(text))
        if found:
            match = found[-1] if self.options.occurrence == "last" else found[0]
            return (match.group(1) if self._pattern.groups else match.group(0)).strip()
        if self.options.fallback == "last_number":
            numbers = NUMBER.findall(text)
            if numbers:
                return numbers[-1]
        return None

    def same(self, answer: str, reference: str) -> bool:
        """Whether two extracted answers agree: numerically when both hold a number (the whole
        text, else its first number, so ``72 clips`` is 72), else as normalised text."""
        if self.options.numeric:
            a, b = leading_number(answer), leading_number(reference)
            if a is not None and b is not None:
                return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
        return self.options.normalize(answer) == self.options.normalize(reference)

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        refs = references(row, self.options.reference)
        if self.options.extract_reference:
            refs = [self.extract(r) or r for r in refs]
        answers = [self.extract(t) for t in generation_texts(record)]
        scores = first_any_mean([a is not None and any(self.same(a, r) for r in refs) for a in answers])
        scores["extracted"] = sum(a is not None for a in answers) / len(answers) if answers else None
        return scores

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        return mean_aggregate(scores, keys=("first", "any", "mean", "extracted"))


class LengthOptions(BaseModel):
    """``length`` has no options."""

    model_config = ConfigDict(extra="forbid")


class Length:
    """Per record: mean tokens and characters over its generations, and the truncated fraction."""

    name = "length"
    required_columns: tuple[str, ...] = ()

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        gens = list(record.get("generations") or ())
        if not gens:
            return {"tokens": None, "chars": None, "tokens_first": None, "truncated": None}
        tokens = [g.get("num_tokens") for g in gens]
        known = [t for t in tokens if t is not None]
        return {
            "tokens": sum(known) / len(known) if known else None,
            "chars": sum(len(str(g.get("text", ""))) for g in gens) / len(gens),
            "tokens_first": tokens[0],
            "truncated": sum(g.get("finish_reason") == "length" for g in gens) / len(gens),
        }

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        out = distribution_stats((s.get("tokens") for s in scores), "tokens")
        out |= distribution_stats((s.get("chars") for s in scores), "chars")
        out |= {f"{k}_frac": v for k, v in mean_aggregate(scores, keys=("truncated",)).items()}
        return out


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


def _need(options: BaseModel, cls: type[BaseModel]) -> Any:
    assert isinstance(options, cls), f"expected {cls.__name__}, got {type(options).__name__}"
    return options


@hookimpl
def batchgen_register_metrics() -> list[MetricSpec]:
    """The built-in metrics: ``exact_match``, ``contains``, ``regex_match``, ``length``, ``json_valid``
    and ``json_schema_valid``; and the scoring jobs' (:mod:`batchgen.plugins.scoring_metrics`)."""
    return [
        MetricSpec(
            "exact_match",
            "A generation equals the reference column after normalisation (first/any/mean).",
            ReferenceOptions,
            lambda o: ExactMatch(_need(o, ReferenceOptions)),
        ),
        MetricSpec(
            "contains",
            "The normalised reference occurs in the generation (first/any/mean).",
            ReferenceOptions,
            lambda o: Contains(_need(o, ReferenceOptions)),
        ),
        MetricSpec(
            "regex_match",
            "Extract the final answer by regex (GSM8K '#### 42', else the last number) and compare.",
            RegexMatchOptions,
            lambda o: RegexMatch(_need(o, RegexMatchOptions)),
        ),
        MetricSpec(
            "length",
            "Generated tokens and characters per record, and the fraction cut by max_tokens.",
            LengthOptions,
            lambda o: Length(),
        ),
        MetricSpec(
            "json_valid",
            "The generation is one strict JSON value (first/any/mean).",
            JsonValidOptions,
            lambda o: JsonValid(_need(o, JsonValidOptions)),
        ),
        MetricSpec(
            "json_schema_valid",
            "The generation is JSON that the job's (or the given) JSON schema accepts (first/any/mean).",
            JsonSchemaValidOptions,
            lambda o: JsonSchemaValid(_need(o, JsonSchemaValidOptions)),
        ),
    ] + scoring_metric_specs()
