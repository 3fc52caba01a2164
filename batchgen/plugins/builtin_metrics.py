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
  with the ``jsonschema`` library (``pip install 'batchgen[structured]'``). These two, and the JSON
  parsing and schema loading they share, are :mod:`batchgen.plugins.json_metrics`'s.

The match and JSON metrics score every generation of a record and report ``first`` (generation 0: the
greedy answer or the best beam), ``any`` (some generation matched; the pass@n view) and ``mean``
(the fraction that matched). A reference column may hold one answer or a list of accepted
answers; a generation matches if it matches any of them.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchgen.metrics import Scores, distribution_stats, first_any_mean, generation_texts, mean_aggregate
from batchgen.plugins.hookspecs import hookimpl
from batchgen.plugins.json_metrics import (  # noqa: F401 - parse_json, load_schema, schema_validator and
    STRUCTURED_EXTRA,                      # STRUCTURED_EXTRA re-exported: their import path before the split
    JsonSchemaValid,
    JsonSchemaValidOptions,
    JsonValid,
    JsonValidOptions,
    load_schema,
    parse_json,
    schema_validator,
)
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
