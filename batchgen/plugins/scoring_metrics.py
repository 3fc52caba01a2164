"""The built-in metrics of scoring jobs (``generation.mode: loglikelihood`` / ``perplexity``),
registered with the other built-ins (:mod:`batchgen.plugins.builtin_metrics`).

* ``accuracy``: the most likely choice is the answer (lm-eval's ``acc``): ``{"acc"}``.
* ``accuracy_norm``: the most likely choice per character of its text is the answer (lm-eval's
  ``acc_norm``, which divides by ``len(choice)`` in characters): ``{"acc_norm"}``
  (:func:`normalized_choice`, from the record's ``choices``).
* ``perplexity``: per record its log-likelihood and counts; over the run, lm-eval
  ``wikitext``'s ``word_perplexity = exp(-sum ll / sum words)``, ``byte_perplexity =
  exp(-sum ll / sum bytes)``, ``bits_per_byte = -sum ll / sum bytes / ln 2``, and
  ``token_perplexity = exp(-sum ll / sum tokens)``.

A scoring job with no ``metrics:`` gets what its kind implies
(:meth:`batchgen.config.formats.ScoringKind.implied_metrics`: ``accuracy`` and
``accuracy_norm`` for loglikelihood with an ``answer``, ``perplexity``). A record without the fields a
metric reads (a generation record, a row with no answer) scores None, left out of the means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from batchgen.metrics import Scores, mean_aggregate
from batchgen.plugins.specs import MetricSpec

__all__ = ["normalized_choice", "scoring_metric_specs"]


class NoOptions(BaseModel):
    """These metrics have no options."""

    model_config = ConfigDict(extra="forbid")


def normalized_choice(choices: Sequence[Mapping[str, Any]]) -> int | None:
    """lm-eval's ``acc_norm`` pick: the argmax of ``logprob / len(text)``, the text's length in
    characters (not its UTF-8 bytes; an empty text counts 1), the first of equal ones. None
    when ``choices`` (a record's ``[{"text", "logprob", ...}]``) is missing or malformed."""
    try:
        normed = [float(c["logprob"]) / max(len(c["text"]), 1) for c in choices]
    except (KeyError, TypeError, ValueError):
        return None
    return max(range(len(normed)), key=lambda i: normed[i]) if normed else None


class Accuracy:
    """The picked choice equals ``answer``: ``chosen`` (``accuracy``), or for ``accuracy_norm``
    the :func:`normalized_choice` of the record's choices."""

    required_columns: tuple[str, ...] = ()

    def __init__(self, name: str, key: str, normalized: bool) -> None:
        self.name, self.key, self.normalized = name, key, normalized

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        answer = record.get("answer")
        if self.normalized:
            choices = record.get("choices")
            chosen = normalized_choice(choices) if isinstance(choices, list) else None
        else:
            chosen = record.get("chosen")
        if chosen is None or answer is None:
            return {self.key: None}
        return {self.key: float(chosen == answer)}

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        return mean_aggregate(scores, keys=(self.key,))


class Perplexity:
    """Log-likelihood and counts per record; perplexities over the run."""

    name = "perplexity"
    required_columns: tuple[str, ...] = ()
    _FIELDS = {"loglikelihood": "loglikelihood", "tokens": "num_tokens", "words": "num_words", "bytes": "num_bytes"}

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        return {key: record.get(field) for key, field in self._FIELDS.items()}

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        known = [s for s in scores if all(isinstance(s.get(k), (int, float)) for k in self._FIELDS)]
        if not known:
            return {}
        total = {k: float(sum(s[k] for s in known)) for k in self._FIELDS}  # type: ignore[misc]
        ll = total["loglikelihood"]
        out = {}
        for key, count in (("word_perplexity", "words"), ("byte_perplexity", "bytes"), ("token_perplexity", "tokens")):
            if total[count] > 0:
                out[key] = math.exp(-ll / total[count])
        if total["bytes"] > 0:
            out["bits_per_byte"] = -ll / total["bytes"] / math.log(2)
        return out


def scoring_metric_specs() -> list[MetricSpec]:
    """The specs of ``accuracy``, ``accuracy_norm`` and ``perplexity``."""
    return [
        MetricSpec("accuracy", "Loglikelihood jobs: the most likely choice is the answer (lm-eval's acc).",
                   NoOptions, lambda o: Accuracy("accuracy", "acc", normalized=False)),
        MetricSpec("accuracy_norm", "Loglikelihood jobs: the most likely choice per character is the answer "
                   "(lm-eval's acc_norm).", NoOptions, lambda o: Accuracy("accuracy_norm", "acc_norm", normalized=True)),
        MetricSpec("perplexity", "Perplexity jobs: word, byte and token perplexity and bits per byte over the "
                   "run (lm-eval's wikitext).", NoOptions, lambda o: Perplexity()),
    ]
