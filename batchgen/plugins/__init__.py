"""batchgen's plugin system, built on pluggy.

Plugins contribute samplers (logits processors) and metrics through the hooks in
:mod:`batchgen.plugins.hookspecs`, and may observe a run through its lifecycle hooks. They are
found through the ``batchgen`` entry-point group and the config's ``plugins`` list; batchgen's own
samplers and metrics register through the same hooks. See docs/plugins.md.

The package, one noun a module: :mod:`~batchgen.plugins.specs` (what a plugin hands over),
:mod:`~batchgen.plugins.loaders` (where plugins come from), :mod:`~batchgen.plugins.registry`
(what a name picks), :mod:`~batchgen.plugins.guards` (the wrappers that name a failing plugin),
:mod:`~batchgen.plugins.options` (options models read for messages and listings).

This package imports neither torch nor any other heavy dependency.
"""

from batchgen.plugins.errors import PluginError
from batchgen.plugins.guards import GuardedProcessor, GuardedStatefulProcessor, PluginMetric
from batchgen.plugins.hookspecs import HOOK_NAMES, LIFECYCLE_HOOKS, hookimpl, hookspec
from batchgen.plugins.loaders import ENTRY_POINT_GROUP, load_registry
from batchgen.plugins.registry import PluginRegistry, Registration
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
    "Registration",
    "SamplerSpec",
    "StatefulLogitsProcessor",
    "allow_only",
    "hookimpl",
    "hookspec",
    "load_registry",
]
