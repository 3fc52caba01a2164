"""The built-in metrics of scoring jobs (``generation.mode: loglikelihood`` / ``perplexity``),
registered with the other built-ins (:mod:`batchgen.plugins.builtin_metrics`).

* ``accuracy``: the most likely choice is the answer (lm-eval's ``acc``): ``{"acc"}``.
* ``accuracy_norm``: the most likely choice per UTF-8 byte is the answer (lm-eval's
  ``acc_norm``): ``{"acc_norm"}``.
* ``perplexity``: per record its log-likelihood and counts; over the run, lm-eval
  ``wikitext``'s ``word_perplexity = exp(-sum ll / sum words)``, ``byte_perplexity =
  exp(-sum ll / sum bytes)``, ``bits_per_byte = -sum ll / sum bytes / ln 2``, and
  ``token_perplexity = exp(-sum ll / sum tokens)``.

A scoring job with no ``metrics:`` gets ``accuracy`` and ``accuracy_norm`` (loglikelihood with
an ``answer``) or ``perplexity`` (:func:`implied_metrics`). A record without the fields a
metric reads (a generation record, a row with no answer) scores None, left out of the means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from batchgen.metrics import Scores, mean_aggregate
from batchgen.plugins.specs import MetricSpec

__all__ = ["implied_metrics", "scoring_metric_specs"]


class NoOptions(BaseModel):
    """These metrics have no options."""

    model_config = ConfigDict(extra="forbid")


class Accuracy:
    """``chosen`` (or ``chosen_norm``) equals ``answer``."""

    required_columns: tuple[str, ...] = ()

    def __init__(self, name: str, field: str, key: str) -> None:
        self.name, self.field, self.key = name, field, key

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        chosen, answer = record.get(self.field), record.get("answer")
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
                   NoOptions, lambda o: Accuracy("accuracy", "chosen", "acc")),
        MetricSpec("accuracy_norm", "Loglikelihood jobs: the most likely choice per byte is the answer "
                   "(lm-eval's acc_norm).", NoOptions, lambda o: Accuracy("accuracy_norm", "chosen_norm", "acc_norm")),
        MetricSpec("perplexity", "Perplexity jobs: word, byte and token perplexity and bits per byte over the "
                   "run (lm-eval's wikitext).", NoOptions, lambda o: Perplexity()),
    ]


def implied_metrics(generation: Any) -> list[str]:
    """The metric names a scoring job gets when its config lists none."""
    if generation.mode == "loglikelihood":
        return ["accuracy", "accuracy_norm"] if generation.answer is not None else []
    if generation.mode == "perplexity":
        return ["perplexity"]
    return []
