"""The guard wrappers: a plugin's processor or metric, called as it is, whose every failure
becomes a :class:`~batchgen.plugins.errors.PluginError` naming the plugin.

* :class:`GuardedProcessor`: a stateless logits processor; also checks the shape and that no row
  gains a NaN or a ``+inf``.
* :class:`GuardedStatefulProcessor`: a :class:`StatefulLogitsProcessor`; its states stay guarded
  through forks.
* :class:`PluginMetric`: a metric whose scores are checked to be a flat JSON-safe dict.

This module imports neither torch nor any other heavy dependency (a processor's tensors are
used through their methods only).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.metrics import Metric, Scores
from batchgen.plugins.errors import PluginError, failures_named
from batchgen.plugins.specs import LogitsProcessor, ProcessorState, StatefulLogitsProcessor


def _clean_value(value: Any) -> float | int | bool | None:
    """A score value as a JSON-safe Python scalar; non-finite floats become None.

    Raises:
        TypeError: for anything that is not None, a bool or a real number.
    """
    if value is None:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    raise TypeError(f"{type(value).__name__} {value!r}")


def _clean_scores(result: Any, what: str) -> dict[str, Any]:
    """Check that a metric returned a flat ``{str: scalar}`` dict and make it JSON-safe."""
    if not isinstance(result, Mapping):
        raise TypeError(f"{what} returned {type(result).__name__}, expected a dict")
    cleaned: dict[str, Any] = {}
    for key, value in result.items():
        if not isinstance(key, str):
            raise TypeError(f"{what} returned a non-string key {key!r}")
        try:
            cleaned[key] = _clean_value(value)
        except TypeError as exc:
            raise TypeError(
                f"{what} returned {exc} for key '{key}', expected float, int, bool or None"
            ) from None
    return cleaned


class GuardedProcessor:
    """A plugin's logits processor that names its plugin when it fails.

    It fails when the processor raises, returns a tensor of another shape, or returns a row
    holding NaN or ``+inf`` (masking is ``-inf``; a NaN or a ``+inf`` would make greedy and
    sampling pick garbage silently). The wrapper adds one Python call, a shape check and one
    row-wise max per step; it never copies the logits.
    """

    def __init__(self, inner: LogitsProcessor, name: str, label: str) -> None:
        self.inner = inner
        self.name = name
        self.label = label

    def __call__(self, logits: Any, output_token_ids: list[list[int]]) -> Any:
        with failures_named(f"sampler '{self.name}' ({self.label}) failed"):
            out = self.inner(logits, output_token_ids)
        if getattr(out, "shape", None) != logits.shape:
            raise PluginError(
                f"sampler '{self.name}' ({self.label}) returned "
                f"{getattr(out, 'shape', type(out).__name__)}, expected a tensor of shape "
                f"{tuple(logits.shape)}"
            )
        # One reduction: a row's max is NaN when the row holds a NaN, +inf when it holds a +inf.
        top = out.amax(dim=-1) if out.numel() else out
        bad = ~(top < math.inf)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            what = "NaN" if bool(top[bad].isnan().any()) else "+inf"
            raise PluginError(
                f"sampler '{self.name}' ({self.label}) returned {what} logits in row(s) {rows[:8]}; "
                "a processor may only lower logits (use -inf to mask a token)"
            )
        return out

    def __repr__(self) -> str:
        return f"GuardedProcessor({self.name!r}, {self.inner!r})"


class _GuardedState:
    """A plugin's processor state whose failures name the plugin; forks stay guarded."""

    __slots__ = ("inner", "where")

    def __init__(self, inner: ProcessorState, where: str) -> None:
        self.inner = inner
        self.where = where

    def fork(self) -> _GuardedState:
        try:
            return _GuardedState(self.inner.fork(), self.where)
        except Exception as exc:
            raise PluginError(f"{self.where} failed in fork(): {type(exc).__name__}: {exc}") from exc

    def accept_token(self, token_id: int) -> None:
        try:
            self.inner.accept_token(token_id)
        except Exception as exc:
            raise PluginError(f"{self.where} failed in accept_token({token_id}): {type(exc).__name__}: {exc}") from exc


class GuardedStatefulProcessor(StatefulLogitsProcessor):
    """A plugin's :class:`StatefulLogitsProcessor` that names its plugin when it fails.

    Every call (``new_state``, ``fill_mask``, ``process`` and the states' ``fork`` and
    ``accept_token``) raises :class:`PluginError` naming the plugin when the plugin's code
    raises; ``process`` is checked like :class:`GuardedProcessor` (shape, NaN, ``+inf``).
    """

    def __init__(self, inner: StatefulLogitsProcessor, name: str, label: str) -> None:
        self.inner = inner
        self.name = name
        self.label = label
        self._where = f"sampler '{name}' ({label})"
        self._check = GuardedProcessor(lambda logits, states: self.inner.process(logits, states), name, label)

    @property
    def masks(self) -> bool:
        return self.inner.masks

    @property
    def edits(self) -> bool:
        return self.inner.edits

    def new_state(self, prompt_token_ids: Sequence[int], params: Any) -> ProcessorState:
        try:
            return _GuardedState(self.inner.new_state(prompt_token_ids, params), self._where)
        except Exception as exc:
            raise PluginError(f"{self._where} failed in new_state(): {type(exc).__name__}: {exc}") from exc

    def fill_mask(self, states: Sequence[Any], bitmask: Any, rows: Sequence[int]) -> None:
        try:
            self.inner.fill_mask([s.inner for s in states], bitmask, rows)
        except Exception as exc:
            raise PluginError(f"{self._where} failed in fill_mask(): {type(exc).__name__}: {exc}") from exc

    def process(self, logits: Any, states: Sequence[Any]) -> Any:
        return self._check(logits, [s.inner for s in states])

    def __repr__(self) -> str:
        return f"GuardedStatefulProcessor({self.name!r}, {self.inner!r})"


class PluginMetric:
    """A plugin's metric that names its plugin when it fails and keeps its output JSON-safe.

    It satisfies :class:`batchgen.metrics.Metric`. ``score`` and ``aggregate`` raise
    :class:`PluginError` (chained to the original exception) when the plugin's code raises or
    returns something that is not a flat dict of float / int / bool / None.
    """

    def __init__(self, inner: Metric, name: str, plugin: str, label: str) -> None:
        self.inner = inner
        self.name = name
        self.plugin = plugin
        self.label = label
        #: Dataset columns ``score`` reads; empty when the metric does not say.
        self.required_columns: tuple[str, ...] = tuple(getattr(inner, "required_columns", ()) or ())

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        """The inner metric's scores for one record; see :meth:`batchgen.metrics.Metric.score`."""
        where = f"metric '{self.name}' ({self.label})"
        with failures_named(f"{where} failed on record {record.get('id')!r}", self.plugin):
            result = self.inner.score(record, row)
        try:
            return _clean_scores(result, where)
        except TypeError as exc:
            raise PluginError(str(exc), plugin=self.plugin) from None

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        """The inner metric's run-level aggregate; non-finite values become None."""
        where = f"metric '{self.name}' ({self.label})"
        with failures_named(f"{where} failed to aggregate", self.plugin):
            result = self.inner.aggregate(scores)
        try:
            return _clean_scores(result, f"{where} aggregate")
        except TypeError as exc:
            raise PluginError(str(exc), plugin=self.plugin) from None

    def __repr__(self) -> str:
        return f"PluginMetric({self.name!r}, {self.inner!r})"
