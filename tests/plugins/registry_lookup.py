"""Registry look-ups only the tests need (the pipeline goes through ``resolve`` and ``build_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from batchgen.metrics import Metric, Scores
from batchgen.plugins.guards import PluginMetric
from batchgen.plugins.registry import Kind, PluginRegistry


def plugin_of(registry: PluginRegistry, kind: Kind, name: str) -> str:
    """The registered name of the plugin whose ``kind`` ``name`` picks."""
    return registry.resolve(kind, name).plugin.name


def validate_options(registry: PluginRegistry, kind: Kind, name: str,
                     options: Mapping[str, Any] | None) -> BaseModel:
    """``options`` validated against the named sampler's or metric's options model, without
    building it (``PluginError`` as ``build_sampler`` / ``build_metric`` raise it)."""
    return registry._validated(registry.resolve(kind, name), options)


def safe_score(metric: Metric, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
    """Score one record, a failure becoming a ``PluginError`` naming the metric, also for a
    metric object not built by the registry."""
    if isinstance(metric, PluginMetric):
        return metric.score(record, row)
    name = getattr(metric, "name", type(metric).__name__)
    return PluginMetric(metric, name, name, f"metric object {type(metric).__name__}").score(record, row)
