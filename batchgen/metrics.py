"""The metric contract and the helpers metric plugins share.

A metric scores each finished record on its own (``score``) and then folds the per-record
scores into run-level numbers (``aggregate``). The pipeline stores a record's scores under the
metric's name in the record's ``metrics`` and the aggregate under the same name in the run
summary. Run-level throughput and KV-cache statistics are not metrics: the pipeline computes
them from the engine.

This module imports neither torch nor any other heavy dependency (numpy only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

#: The value type of one per-record score. None means "not applicable" and is left out of means.
Score = Union[float, int, bool, None]
#: One record's scores: a flat mapping from a score key to its value.
Scores = dict[str, Score]


@runtime_checkable
class Metric(Protocol):
    """A per-record score plus a run-level aggregate.

    Attributes:
        name: The metric's name (the spec name it was built from).

    Optionally a metric also has ``required_columns: tuple[str, ...]``, the dataset columns its
    ``score`` reads from ``row``; ``batchgen validate`` checks they exist before a run.

    Optionally a metric also has ``configure(config) -> None``, for a metric that depends on the
    job (``json_schema_valid`` takes the job's JSON schema). It is called once when the job is
    planned (by ``batchgen validate`` too), before any record is scored, with the resolved run
    configuration as plain JSON-compatible data (the dict the run summary holds). Raising
    ``ValueError`` there reports a config error at the metric's entry (``metrics.<i>``).
    """

    name: str

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        """Score one finished record.

        Args:
            record: The output record: ``id``, ``prompt`` and ``generations``, a list of
                ``{"text", "finish_reason", "num_tokens", "cumulative_logprob", ...}`` (one per
                sample or beam, in index order). Never mutated.
            row: The dataset row the record was made from (its columns). Never mutated.

        Returns:
            A flat dict whose values are float, int, bool or None, with the same keys for every
            record (use None where a key does not apply).
        """
        ...

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        """Fold the per-record scores of a whole run into run-level numbers."""
        ...


def generation_texts(record: Mapping[str, Any]) -> list[str]:
    """The texts of a record's generations, in index order (empty for an error record)."""
    return [str(g.get("text", "")) for g in record.get("generations") or ()]


def _as_number(value: Any) -> float | None:
    """A score value as a float for averaging; None (and anything non-numeric) is skipped."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def mean_aggregate(scores: Iterable[Mapping[str, Score]], keys: Sequence[str] | None = None) -> dict[str, float]:
    """Per key, the mean over records of its numeric values (bools count as 0/1).

    None values are skipped, so a key that never applied is left out of the result instead of
    being reported as 0. ``keys`` restricts and orders the keys; by default every key seen is
    used, in first-seen order.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    order: list[str] = list(keys) if keys is not None else []
    for record_scores in scores:
        for key, value in record_scores.items():
            if keys is None and key not in sums and key not in order:
                order.append(key)
            number = _as_number(value)
            if number is None:
                continue
            sums[key] = sums.get(key, 0.0) + number
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in order if counts.get(key)}


def distribution_stats(values: Iterable[float | int | None], prefix: str) -> dict[str, float]:
    """Mean, min, p50, p90, max of the non-None values, keyed ``{prefix}_{stat}``.

    Returns an empty dict when there is no value. Percentiles interpolate linearly (numpy's
    default), so p50 of ``[1, 2]`` is 1.5.
    """
    data = np.asarray([float(v) for v in values if v is not None], dtype=np.float64)
    if data.size == 0:
        return {}
    return {
        f"{prefix}_mean": float(data.mean()),
        f"{prefix}_min": float(data.min()),
        f"{prefix}_p50": float(np.percentile(data, 50)),
        f"{prefix}_p90": float(np.percentile(data, 90)),
        f"{prefix}_max": float(data.max()),
    }


def first_any_mean(flags: Sequence[bool]) -> Scores:
    """Summarise one record's per-generation outcomes.

    ``first`` is the outcome of generation 0 (the greedy answer, or the best beam), ``any`` is
    whether some generation succeeded and ``mean`` the fraction that did. All three are None for
    a record without generations.
    """
    if not flags:
        return {"first": None, "any": None, "mean": None}
    return {"first": bool(flags[0]), "any": any(flags), "mean": sum(map(bool, flags)) / len(flags)}
