"""The plugin registry: the loaded plugins, the samplers and metrics they registered, and how a
name in a config finds one of them.

Names (docs/plugins.md, "Names"):

* Every sampler and metric is reachable by its qualified name ``PLUGIN:NAME``, ``PLUGIN`` being
  the plugin's registered name or, for an entry point, its distribution's name (compared as
  pip compares them: case, ``-``, ``_`` and ``.`` alike); batchgen's own are ``batchgen:NAME``.
* A bare ``NAME`` picks the one registration of that name. When a third-party plugin registers
  a name that a built-in also has, the bare name picks the plugin's (one warning line says so
  the first time it is used). When two third-party plugins register one name, the bare name is
  an error naming both and their qualified names; each stays reachable qualified.
* Nothing of this fails while loading: a clash fails only the job that uses the clashing bare
  name, and ``batchgen plugins`` lists every registration with its clash marked.

This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pluggy
from pydantic import BaseModel, ValidationError

from batchgen.plugins.errors import PluginError, failures_named
from batchgen.plugins.guards import GuardedProcessor, GuardedStatefulProcessor, PluginMetric
from batchgen.plugins.hookspecs import LIFECYCLE_HOOKS, PROJECT_NAME
from batchgen.plugins.options import describe_options, format_validation_error
from batchgen.plugins.specs import MetricSpec, SamplerSpec, StatefulLogitsProcessor
from batchgen.suggest import did_you_mean

logger = logging.getLogger(__name__)

Kind = Literal["sampler", "metric"]
#: The qualifier of batchgen's own samplers and metrics: ``batchgen:json_valid``.
BUILTIN_QUALIFIER = PROJECT_NAME


def canonical(name: str) -> str:
    """A distribution or plugin name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PluginInfo:
    """Where a registered plugin came from."""

    name: str
    source: Literal["built-in", "entry point", "module"]
    distribution: str | None = None
    version: str | None = None

    @property
    def label(self) -> str:
        """``plugin 'typical' from batchgen-typical 0.1.0`` and the like, for messages."""
        if self.distribution:
            return f"plugin '{self.name}' from {self.distribution} {self.version}"
        return f"plugin '{self.name}' ({self.source})"

    @property
    def builtin(self) -> bool:
        return self.source == "built-in"

    @property
    def qualifier(self) -> str:
        """What goes before the colon of this plugin's qualified names."""
        return BUILTIN_QUALIFIER if self.builtin else self.name

    def answers_to(self, qualifier: str) -> bool:
        """Whether ``qualifier`` (before a colon) names this plugin."""
        names = [self.name, self.qualifier] + ([self.distribution] if self.distribution else [])
        return canonical(qualifier) in {canonical(n) for n in names}


@dataclass(frozen=True)
class Registration:
    """One sampler or metric as one plugin registered it."""

    kind: Kind
    name: str
    plugin: PluginInfo
    spec: SamplerSpec | MetricSpec

    @property
    def qualified_name(self) -> str:
        """``PLUGIN:NAME``, which always picks this registration."""
        return f"{self.plugin.qualifier}:{self.name}"

    @property
    def where(self) -> str:
        """``sampler 'typical' (plugin 'typical' from batchgen-typical 0.1.0)``, for messages."""
        return f"{self.kind} '{self.name}' ({self.plugin.label})"


class PluginRegistry:
    """The loaded plugins and the samplers and metrics they registered.

    Attributes:
        pm: The pluggy plugin manager.
        hook: ``pm.hook``; e.g. ``registry.hook.batchgen_run_start(config=...)``. Prefer
            :meth:`notify`, which names the plugin when an implementation fails.
        samplers: Bare sampler name -> the spec that name picks (a name two third-party plugins
            register is absent: it needs a qualified name; see :meth:`resolve`).
        metrics: The same for metrics.
    """

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
        self.pm = pm
        self.hook = pm.hook
        self._infos = infos
        self._table: dict[Kind, dict[str, list[Registration]]] = {"sampler": {}, "metric": {}}
        self._warned: set[tuple[Kind, str]] = set()
        self._collect("sampler", "batchgen_register_samplers", SamplerSpec)
        self._collect("metric", "batchgen_register_metrics", MetricSpec)
        self.samplers: dict[str, SamplerSpec] = self._picked("sampler")  # type: ignore[assignment]
        self.metrics: dict[str, MetricSpec] = self._picked("metric")  # type: ignore[assignment]

    # -- loading -------------------------------------------------------------------------------

    def _info(self, plugin_name: str) -> PluginInfo:
        return self._infos.get(plugin_name) or PluginInfo(plugin_name, "module")

    def _plugins_implementing(self, hook_name: str, call_order: bool) -> list[tuple[str, object]]:
        """The plugins implementing ``hook_name``: in the order pluggy would call them
        (last registered first, tryfirst/trylast respected), or else in registration order."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        seen: list[tuple[str, object]] = []
        for impl in reversed(impls) if call_order else impls:
            if all(plugin is not impl.plugin for _, plugin in seen):
                seen.append((impl.plugin_name, impl.plugin))
        return seen

    def _call_one(self, hook_name: str, plugin: object, kwargs: dict[str, Any]) -> list[Any]:
        """Call ``hook_name`` on one plugin only, through pluggy (so hook options still apply)."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)

    def _collect(self, kind: Kind, hook_name: str, spec_type: type) -> None:
        table = self._table[kind]
        # Registration order: built-ins, entry points, then the config's modules.
        for plugin_name, plugin in self._plugins_implementing(hook_name, call_order=False):
            info = self._info(plugin_name)
            try:
                results = self._call_one(hook_name, plugin, {})
            except Exception as exc:
                raise PluginError(
                    f"{info.label} failed in {hook_name}: {type(exc).__name__}: {exc}", plugin=plugin_name
                ) from exc
            for result in results:
                if result is None:
                    continue
                if not isinstance(result, (list, tuple)):
                    raise PluginError(
                        f"{info.label}: {hook_name} must return a list of {spec_type.__name__}, "
                        f"got {type(result).__name__}",
                        plugin=plugin_name,
                    )
                for spec in result:
                    _check_spec(kind, spec, spec_type, plugin_name, info.label)
                    others = table.setdefault(spec.name, [])
                    if any(r.plugin.name == plugin_name for r in others):
                        raise PluginError(f"{info.label} registers {kind} '{spec.name}' twice", plugin=plugin_name)
                    others.append(Registration(kind, spec.name, info, spec))

    def _picked(self, kind: Kind) -> dict[str, Any]:
        picked = {}
        for name, regs in self._table[kind].items():
            choice = _pick(regs)
            if choice is not None:
                picked[name] = choice.spec
        return picked

    # -- names ---------------------------------------------------------------------------------

    def resolve(self, kind: Kind, name: str) -> Registration:
        """The registration ``name`` (bare or ``PLUGIN:NAME``) picks, by the rules above.

        Raises:
            PluginError: an unknown name (with did-you-mean and what is installed), or a bare
                name two third-party plugins register (naming both, with their qualified names).
        """
        table = self._table[kind]
        regs = table.get(name)
        if regs:
            choice = _pick(regs)
            if choice is None:
                third = [r for r in regs if not r.plugin.builtin]
                choices = " or ".join(f"'{r.qualified_name}'" for r in regs)
                raise PluginError(
                    f"{kind} '{name}' is registered by {len(third)} plugins: "
                    + " and ".join(r.plugin.label for r in third)
                    + f"; write one of {choices} to choose",
                    plugin=third[0].plugin.name,
                )
            if len(regs) > 1 and (kind, name) not in self._warned:
                self._warned.add((kind, name))
                builtin = next(r for r in regs if r.plugin.builtin)
                logger.warning("batchgen: warning: %s '%s' of %s is used in place of the built-in one; write '%s' "
                               "for the built-in", kind, name, choice.plugin.label, builtin.qualified_name)
            return choice
        qualifier, colon, bare = name.partition(":")
        if colon:
            for reg in table.get(bare, ()):
                if reg.plugin.answers_to(qualifier):
                    return reg
        known = sorted(table) + sorted(r.qualified_name for regs in table.values() for r in regs)
        installed = ", ".join(f"'{n}'" for n in sorted(table)) or "none"
        raise PluginError(f"unknown {kind} plugin '{name}'{did_you_mean(name, known)}; installed: {installed}")

    # -- building ------------------------------------------------------------------------------

    @staticmethod
    def _validated(reg: Registration, options: Mapping[str, Any] | None) -> BaseModel:
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise PluginError(
                f"{reg.where}: options must be a mapping, got {type(options).__name__}", plugin=reg.plugin.name
            )
        try:
            return reg.spec.options_model.model_validate(dict(options))
        except ValidationError as exc:
            lines = format_validation_error(exc, reg.spec.options_model)
            raise PluginError(
                f"{reg.where}: invalid options:\n" + "\n".join(f"  {line}" for line in lines),
                plugin=reg.plugin.name,
            ) from None

    def _build(self, kind: Kind, name: str, options: Mapping[str, Any] | None) -> tuple[Any, Registration]:
        reg = self.resolve(kind, name)
        validated = self._validated(reg, options)
        with failures_named(f"{reg.where} could not be built", reg.plugin.name):
            built = reg.spec.factory(validated)
        return built, reg

    def build_sampler(
        self, name: str, options: Mapping[str, Any] | None = None
    ) -> GuardedProcessor | GuardedStatefulProcessor:
        """Build the named sampler's logits processor from raw config options.

        The result is called like the plugin's processor and raises :class:`PluginError` naming
        the plugin if that raises or returns a tensor of the wrong shape. A factory returning a
        :class:`StatefulLogitsProcessor` gets a :class:`GuardedStatefulProcessor`.
        """
        built, reg = self._build("sampler", name, options)
        label = reg.plugin.label
        if isinstance(built, StatefulLogitsProcessor):
            if not (built.masks or built.edits):
                raise PluginError(
                    f"{reg.where}: {type(built).__name__} overrides neither fill_mask() nor process(), "
                    "so it would do nothing",
                    plugin=reg.plugin.name,
                )
            return GuardedStatefulProcessor(built, reg.name, label)
        if not callable(built):
            raise PluginError(
                f"{reg.where}: factory returned {type(built).__name__}, "
                "expected a callable logits processor or a StatefulLogitsProcessor",
                plugin=reg.plugin.name,
            )
        return GuardedProcessor(built, reg.name, label)

    def build_metric(self, name: str, options: Mapping[str, Any] | None = None) -> PluginMetric:
        """Build the named metric from raw config options; see :class:`PluginMetric`."""
        built, reg = self._build("metric", name, options)
        if not (callable(getattr(built, "score", None)) and callable(getattr(built, "aggregate", None))):
            raise PluginError(
                f"{reg.where}: factory returned {type(built).__name__}, expected an object with score() and aggregate()",
                plugin=reg.plugin.name,
            )
        return PluginMetric(built, reg.name, reg.plugin.name, reg.plugin.label)

    # -- lifecycle -----------------------------------------------------------------------------

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Fire a lifecycle hook on every plugin implementing it, in pluggy's call order.

        Each plugin's implementation is called on its own so that a failure names the plugin.

        Raises:
            PluginError: the first implementation that raised, named; the later ones are not
                called.
            ValueError: ``hook_name`` is not a lifecycle hook.
        """
        if hook_name not in LIFECYCLE_HOOKS:
            raise ValueError(f"{hook_name!r} is not a lifecycle hook; expected one of {LIFECYCLE_HOOKS}")
        for plugin_name, plugin in self._plugins_implementing(hook_name, call_order=True):
            try:
                self._call_one(hook_name, plugin, kwargs)
            except Exception as exc:
                raise PluginError(
                    f"{self._info(plugin_name).label} failed in {hook_name}: {type(exc).__name__}: {exc}",
                    plugin=plugin_name,
                ) from exc

    # -- listing -------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One entry per loaded plugin, in registration order, for ``batchgen plugins``.

        Each entry has ``name``, ``source`` ("built-in", "entry point" or "module"), ``module``,
        ``distribution`` and ``version`` (None unless loaded from an entry point), ``samplers`` and
        ``metrics`` and ``hooks`` (the lifecycle hooks it implements). Each sampler and metric is
        ``{"name", "qualified_name", "description", "options", "clash"}``: the options as
        :func:`describe_options` lists them, ``clash`` None or one line saying which other
        plugin registers the name and what the bare name picks.
        """
        entries = []
        for plugin_name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # a blocked name
                continue
            info = self._info(plugin_name)
            hooks = sorted(
                caller.name for caller in self.pm.get_hookcallers(plugin) or () if caller.name in LIFECYCLE_HOOKS
            )
            entry: dict[str, Any] = {
                "name": plugin_name,
                "source": info.source,
                "module": getattr(plugin, "__name__", type(plugin).__name__),
                "distribution": info.distribution,
                "version": info.version,
            }
            for kind in ("sampler", "metric"):
                entry[kind + "s"] = [
                    {
                        "name": reg.name,
                        "qualified_name": reg.qualified_name,
                        "description": reg.spec.description,
                        "options": describe_options(reg.spec.options_model),
                        "clash": _clash(reg, regs),
                    }
                    for regs in self._table[kind].values()  # type: ignore[index]
                    for reg in regs
                    if reg.plugin.name == plugin_name
                ]
            entry["hooks"] = hooks
            entries.append(entry)
        return entries


def _pick(regs: Sequence[Registration]) -> Registration | None:
    """What a bare name picks among its registrations: the one, else the one third-party
    registration over a built-in, else None (two or more third-party ones)."""
    if len(regs) == 1:
        return regs[0]
    third = [r for r in regs if not r.plugin.builtin]
    return third[0] if len(third) == 1 else None


def _clash(reg: Registration, regs: Sequence[Registration]) -> str | None:
    """One line about the other registrations of ``reg``'s name, or None when it has none."""
    if len(regs) == 1:
        return None
    others = " and ".join(r.plugin.label for r in regs if r is not reg)
    picked = _pick(regs)
    if picked is None:
        verdict = "the bare name is refused"
    elif picked is reg:
        verdict = "the bare name picks this one"
    else:
        verdict = f"the bare name picks the one of {picked.plugin.label}"
    return f"also registered by {others}: {verdict}; '{reg.qualified_name}' always picks this one"


def _check_spec(kind: Kind, spec: Any, spec_type: type, plugin_name: str, label: str) -> None:
    """Raise :class:`PluginError` naming the plugin unless ``spec`` is a well-formed spec."""
    problem = None
    if not isinstance(spec, spec_type):
        problem = f"returned {type(spec).__name__} instead of a {spec_type.__name__}"
    elif not isinstance(spec.name, str) or not spec.name.strip() or spec.name != spec.name.strip():
        problem = f"registered a {kind} with an invalid name {spec.name!r}"
    elif not (isinstance(spec.options_model, type) and issubclass(spec.options_model, BaseModel)):
        problem = f"{kind} '{spec.name}': options_model must be a pydantic BaseModel subclass"
    elif not callable(spec.factory):
        problem = f"{kind} '{spec.name}': factory is not callable"
    if problem:
        raise PluginError(f"{label} {problem}", plugin=plugin_name)
