"""The loaders: where plugins come from, in this order: batchgen's built-ins, the ``batchgen``
entry-point group of the installed distributions, then the config's ``plugins:`` modules. All
register through the same hooks; :func:`load_registry` is the one entry point.

Invariant: every error a plugin can cause while loading (a module that is missing or fails to
import, an entry point that fails to load, an invalid or misspelt hook implementation, a
malformed spec) is a :class:`PluginError` naming the plugin. A sampler or metric name that two
plugins register is not an error here (see :mod:`batchgen.plugins.registry`).

This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Sequence

import pluggy

from batchgen.plugins import hookspecs
from batchgen.plugins.errors import PluginError
from batchgen.plugins.hookspecs import PROJECT_NAME
from batchgen.plugins.registry import PluginInfo, PluginRegistry

#: The entry-point group third-party plugins declare in their pyproject.toml.
ENTRY_POINT_GROUP = PROJECT_NAME
#: Plugin names of the built-ins; they are registered first, like any other plugin.
BUILTIN_SAMPLERS_PLUGIN = "batchgen-builtin-samplers"
BUILTIN_METRICS_PLUGIN = "batchgen-builtin-metrics"

logger = logging.getLogger(__name__)


def _one_line(exc: BaseException) -> str:
    """pluggy's multi-line validation messages joined into one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _register(pm: pluggy.PluginManager, plugin: object, name: str, what: str) -> None:
    """``pm.register`` with pluggy's validation errors turned into :class:`PluginError`."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{what} has an invalid hook implementation: {_one_line(exc)}", plugin=name) from exc
    except ValueError as exc:  # the name is taken by another plugin
        raise PluginError(f"{what} could not be registered: {exc}", plugin=name) from exc


def _load_entry_points(pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
    """Load the ``batchgen`` entry-point group, one entry point at a time so errors name it."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        dist_version = dist.version if dist is not None else None
        what = f"plugin '{ep.name}' (entry point '{ep.value}'" + (
            f" from {dist_name} {dist_version})" if dist_name else ")"
        )
        if pm.is_blocked(ep.name):
            continue
        name = ep.name
        if pm.get_plugin(ep.name) is not None:
            first = infos.get(ep.name)
            if first is not None and first.distribution == dist_name:
                continue  # the same distribution seen twice on sys.path, as pluggy does
            if not dist_name or pm.get_plugin(dist_name) is not None:
                raise PluginError(
                    f"{what} clashes with {first.label if first else repr(ep.name)}: two plugins "
                    "with one name; uninstall one of them",
                    plugin=ep.name,
                )
            # Two distributions, one plugin name: the later one goes by its distribution's name.
            name = dist_name
            logger.warning("batchgen: warning: %s has the name of %s; it is registered as '%s', so write "
                           "'%s:NAME' for what it registers", what, first.label if first else repr(ep.name), name, name)
        try:
            if name == ep.name:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
            else:
                pm.register(ep.load(), name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"{what} has an invalid hook implementation: {_one_line(exc)}", plugin=name
            ) from exc
        except Exception as exc:
            raise PluginError(
                f"{what} failed to load: {type(exc).__name__}: {exc}", plugin=name
            ) from exc
        infos[name] = PluginInfo(name, "entry point", dist_name, dist_version)


def _load_module(pm: pluggy.PluginManager, module_name: str, infos: dict[str, PluginInfo]) -> None:
    """Import one of the config's extra plugin modules and register it under its module name."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise PluginError(
                f"plugin module '{module_name}' (from the config's 'plugins' list) was not found; "
                "install it or put it on PYTHONPATH",
                plugin=module_name,
            ) from exc
        raise PluginError(
            f"plugin module '{module_name}' failed to import: ModuleNotFoundError: {exc}",
            plugin=module_name,
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"plugin module '{module_name}' failed to import: {type(exc).__name__}: {exc}",
            plugin=module_name,
        ) from exc
    if pm.is_registered(module):
        return  # already loaded, e.g. through its entry point
    _register(pm, module, module_name, f"plugin module '{module_name}'")
    infos[module_name] = PluginInfo(module_name, "module")


def load_registry(extra_modules: Sequence[str] = ()) -> PluginRegistry:
    """Build a :class:`PluginRegistry` from the built-ins, the entry points and ``extra_modules``.

    Args:
        extra_modules: Importable module names from the config's ``plugins`` list. A module that
            is also an installed entry point is registered once.

    Raises:
        PluginError: a module that is missing or fails to import, an entry point that fails to
            load, an invalid or misspelt hook implementation, a malformed spec
            (two plugins registering one sampler or metric name is not an error; see
            :meth:`PluginRegistry.resolve`); each message names the plugin.
    """
    if isinstance(extra_modules, str):
        extra_modules = (extra_modules,)
    # Imported here, not at module level: the built-ins import the hookimpl marker from this
    # package, whose __init__ imports this module.
    from batchgen.plugins import builtin_metrics, builtin_samplers

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    infos: dict[str, PluginInfo] = {}
    for module, name in ((builtin_samplers, BUILTIN_SAMPLERS_PLUGIN), (builtin_metrics, BUILTIN_METRICS_PLUGIN)):
        _register(pm, module, name, f"built-in plugin '{name}'")
        infos[name] = PluginInfo(name, "built-in")
    _load_entry_points(pm, infos)
    for module_name in extra_modules:
        _load_module(pm, module_name, infos)
    try:
        pm.check_pending()  # a hookimpl whose name matches no hookspec, e.g. a typo
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or repr(exc.plugin)
        label = infos[name].label if name in infos else f"plugin '{name}'"
        raise PluginError(f"{label}: {_one_line(exc)}. Known hooks: {', '.join(hookspecs.HOOK_NAMES)}", plugin=name) from exc
    return PluginRegistry(pm, infos)
