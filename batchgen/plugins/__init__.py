"""batchgen's plugin system, built on pluggy.

Plugins contribute samplers (logits processors) and metrics through the hooks in
:mod:`batchgen.plugins.hookspecs`, and may observe a run through its lifecycle hooks. They are
found through the ``batchgen`` entry-point group and the config's ``plugins`` list; batchgen's own
samplers and metrics register through the same hooks. See docs/plugins.md.

This package imports neither torch nor any other heavy dependency.
"""

from batchgen.plugins.hookspecs import HOOK_NAMES, LIFECYCLE_HOOKS, hookimpl, hookspec
from batchgen.plugins.manager import (
    ENTRY_POINT_GROUP,
    GuardedProcessor,
    GuardedStatefulProcessor,
    PluginError,
    PluginMetric,
    PluginRegistry,
    load_registry,
)
from batchgen.plugins.specs import (
    LogitsProcessor,
    MetricSpec,
    ProcessorState,
    SamplerSpec,
    StatefulLogitsProcessor,
    allow_only,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOK_NAMES",
    "LIFECYCLE_HOOKS",
    "GuardedProcessor",
    "GuardedStatefulProcessor",
    "LogitsProcessor",
    "MetricSpec",
    "PluginError",
    "PluginMetric",
    "PluginRegistry",
    "ProcessorState",
    "SamplerSpec",
    "StatefulLogitsProcessor",
    "allow_only",
    "hookimpl",
    "hookspec",
    "load_registry",
]
