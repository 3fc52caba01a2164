"""Building the plugin registry: pluggy's manager plus checked, named samplers and metrics.

:func:`load_registry` is the one entry point. It registers, in this order, batchgen's built-in
plugins, every plugin of the ``batchgen`` entry-point group and the config's extra modules, all
through the same hook mechanism, then asks each plugin for its specs.

Invariant: every error that a plugin can cause (a bad spec, a name clash, bad options, a crashing
factory, processor, metric or lifecycle hook) surfaces as :class:`PluginError` whose message names
the plugin, so the CLI can print it as a configuration or runtime error without a traceback.

This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pluggy
from pydantic import BaseModel, ValidationError

from batchgen.metrics import Metric, Scores
from batchgen.plugins import hookspecs
from batchgen.plugins.hookspecs import LIFECYCLE_HOOKS, PROJECT_NAME
from batchgen.plugins.specs import LogitsProcessor, MetricSpec, ProcessorState, SamplerSpec, StatefulLogitsProcessor

#: The entry-point group third-party plugins declare in their pyproject.toml.
ENTRY_POINT_GROUP = PROJECT_NAME
#: Plugin names of the built-ins; they are registered first, like any other plugin.
BUILTIN_SAMPLERS_PLUGIN = "batchgen-builtin-samplers"
BUILTIN_METRICS_PLUGIN = "batchgen-builtin-metrics"

Kind = Literal["sampler", "metric"]


class PluginError(Exception):
    """A plugin could not be loaded, configured or run; the message names the plugin.

    Attributes:
        plugin: The plugin's registered name, when one is known.
    """

    def __init__(self, message: str, *, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def format_validation_error(error: ValidationError, model: type[BaseModel]) -> list[str]:
    """One ``field: message (got value)`` line per pydantic error, with did-you-mean for extras."""
    fields = list(model.model_fields)
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(options)"
        line = f"{loc}: {item['msg']}"
        if item["type"] == "extra_forbidden":
            line = f"{loc}: unknown option."
            line += _did_you_mean(str(item["loc"][0]), fields) if item["loc"] else ""
            line += f" Allowed options: {', '.join(fields)}." if fields else " This takes no options."
        elif item["type"] != "missing" and "input" in item:
            line += f" (got {item['input']!r})"
        lines.append(line)
    return lines


def _type_name(annotation: Any) -> str:
    """A readable name for an option's type: ``float``, ``list of int``, ``'a' or 'b'``..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, set, frozenset, Sequence):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, Mapping):
        return "mapping"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="), ("max_length", "length <="))


def describe_options(model: type[BaseModel]) -> list[dict[str, Any]]:
    """One entry per option of a plugin's options model: ``name``, ``type``, ``constraints``
    (e.g. ``"> 0, <= 1"``, or None), ``required``, ``default`` (JSON data; None when required)
    and ``description``."""
    from pydantic_core import to_jsonable_python

    options = []
    for name, info in model.model_fields.items():
        bounds = [
            f"{sign} {getattr(meta, attr)}"
            for meta in info.metadata
            for attr, sign in _BOUNDS
            if getattr(meta, attr, None) is not None
        ]
        required = info.is_required()
        default = None if required else info.get_default(call_default_factory=True)
        options.append(
            {
                "name": name,
                "type": _type_name(info.annotation),
                "constraints": ", ".join(bounds) or None,
                "required": required,
                "default": to_jsonable_python(default, fallback=repr),
                "description": info.description,
            }
        )
    return options


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
        try:
            out = self.inner(logits, output_token_ids)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"sampler '{self.name}' ({self.label}) failed: {type(exc).__name__}: {exc}"
            ) from exc
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
        try:
            result = self.inner.score(record, row)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{where} failed on record {record.get('id')!r}: {type(exc).__name__}: {exc}",
                plugin=self.plugin,
            ) from exc
        try:
            return _clean_scores(result, where)
        except TypeError as exc:
            raise PluginError(str(exc), plugin=self.plugin) from None

    def aggregate(self, scores: list[Scores]) -> dict[str, float]:
        """The inner metric's run-level aggregate; non-finite values become None."""
        where = f"metric '{self.name}' ({self.label})"
        try:
            result = self.inner.aggregate(scores)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{where} failed to aggregate: {type(exc).__name__}: {exc}", plugin=self.plugin
            ) from exc
        try:
            return _clean_scores(result, f"{where} aggregate")
        except TypeError as exc:
            raise PluginError(str(exc), plugin=self.plugin) from None

    def __repr__(self) -> str:
        return f"PluginMetric({self.name!r}, {self.inner!r})"


@dataclass(frozen=True)
class _PluginInfo:
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


class PluginRegistry:
    """The loaded plugins and the samplers and metrics they registered.

    Attributes:
        pm: The pluggy plugin manager.
        hook: ``pm.hook``; e.g. ``registry.hook.batchgen_run_start(config=...)``. Prefer
            :meth:`notify`, which names the plugin when an implementation fails.
        samplers: Sampler name → spec.
        metrics: Metric name → spec.
    """

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, _PluginInfo]) -> None:
        self.pm = pm
        self.hook = pm.hook
        self._infos = infos
        self.samplers: dict[str, SamplerSpec] = {}
        self.metrics: dict[str, MetricSpec] = {}
        self._owners: dict[tuple[Kind, str], str] = {}
        self._collect("sampler", "batchgen_register_samplers", SamplerSpec, self.samplers)
        self._collect("metric", "batchgen_register_metrics", MetricSpec, self.metrics)

    # -- loading -------------------------------------------------------------------------------

    def _label(self, plugin_name: str) -> str:
        info = self._infos.get(plugin_name)
        return info.label if info else f"plugin '{plugin_name}'"

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

    def _collect(self, kind: Kind, hook_name: str, spec_type: type, into: dict[str, Any]) -> None:
        # Registration order, so that a clash names the plugin that was there first first.
        for plugin_name, plugin in self._plugins_implementing(hook_name, call_order=False):
            label = self._label(plugin_name)
            try:
                results = self._call_one(hook_name, plugin, {})
            except Exception as exc:
                raise PluginError(
                    f"{label} failed in {hook_name}: {type(exc).__name__}: {exc}", plugin=plugin_name
                ) from exc
            for result in results:
                if result is None:
                    continue
                if not isinstance(result, (list, tuple)):
                    raise PluginError(
                        f"{label}: {hook_name} must return a list of {spec_type.__name__}, "
                        f"got {type(result).__name__}",
                        plugin=plugin_name,
                    )
                for spec in result:
                    self._check_spec(kind, spec, spec_type, plugin_name, label)
                    if spec.name in into:
                        first = self._owners[(kind, spec.name)]
                        raise PluginError(
                            f"{kind} '{spec.name}' is registered twice: by {self._label(first)} "
                            f"and by {label}; uninstall one of them or remove it from 'plugins'",
                            plugin=plugin_name,
                        )
                    into[spec.name] = spec
                    self._owners[(kind, spec.name)] = plugin_name

    @staticmethod
    def _check_spec(kind: Kind, spec: Any, spec_type: type, plugin_name: str, label: str) -> None:
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

    # -- lookup and building -------------------------------------------------------------------

    def plugin_of(self, kind: Kind, name: str) -> str:
        """The registered name of the plugin that contributed ``kind`` ``name``."""
        return self._owners[(kind, name)]

    def _spec(self, kind: Kind, name: str) -> SamplerSpec | MetricSpec:
        table: Mapping[str, Any] = self.samplers if kind == "sampler" else self.metrics
        if name in table:
            return table[name]
        available = ", ".join(sorted(table)) or "(none)"
        raise PluginError(
            f"unknown {kind} '{name}'.{_did_you_mean(str(name), sorted(table))} "
            f"Available {kind}s: {available}. Run 'batchgen plugins' to see what is installed."
        )

    def validate_options(self, kind: Kind, name: str, options: Mapping[str, Any] | None) -> BaseModel:
        """Validate ``options`` against the named sampler's or metric's options model.

        Raises:
            PluginError: unknown name (with did-you-mean and the available names), or invalid
                options (naming the plugin and listing every field error).
        """
        spec = self._spec(kind, name)
        plugin = self._owners[(kind, name)]
        where = f"{kind} '{name}' ({self._label(plugin)})"
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise PluginError(
                f"{where}: options must be a mapping, got {type(options).__name__}", plugin=plugin
            )
        try:
            return spec.options_model.model_validate(dict(options))
        except ValidationError as exc:
            lines = format_validation_error(exc, spec.options_model)
            raise PluginError(
                f"{where}: invalid options:\n" + "\n".join(f"  {line}" for line in lines),
                plugin=plugin,
            ) from None

    def _build(self, kind: Kind, name: str, options: Mapping[str, Any] | None) -> tuple[Any, str, str]:
        validated = self.validate_options(kind, name, options)
        spec = self._spec(kind, name)
        plugin = self._owners[(kind, name)]
        label = self._label(plugin)
        try:
            built = spec.factory(validated)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{kind} '{name}' ({label}) could not be built: {type(exc).__name__}: {exc}",
                plugin=plugin,
            ) from exc
        return built, plugin, label

    def build_sampler(
        self, name: str, options: Mapping[str, Any] | None = None
    ) -> GuardedProcessor | GuardedStatefulProcessor:
        """Build the named sampler's logits processor from raw config options.

        The result is called like the plugin's processor and raises :class:`PluginError` naming
        the plugin if that raises or returns a tensor of the wrong shape. A factory returning a
        :class:`StatefulLogitsProcessor` gets a :class:`GuardedStatefulProcessor`.
        """
        built, plugin, label = self._build("sampler", name, options)
        if isinstance(built, StatefulLogitsProcessor):
            if not (built.masks or built.edits):
                raise PluginError(
                    f"sampler '{name}' ({label}): {type(built).__name__} overrides neither "
                    "fill_mask() nor process(), so it would do nothing",
                    plugin=plugin,
                )
            return GuardedStatefulProcessor(built, name, label)
        if not callable(built):
            raise PluginError(
                f"sampler '{name}' ({label}): factory returned {type(built).__name__}, "
                "expected a callable logits processor or a StatefulLogitsProcessor",
                plugin=plugin,
            )
        return GuardedProcessor(built, name, label)

    def build_metric(self, name: str, options: Mapping[str, Any] | None = None) -> PluginMetric:
        """Build the named metric from raw config options; see :class:`PluginMetric`."""
        built, plugin, label = self._build("metric", name, options)
        if not (callable(getattr(built, "score", None)) and callable(getattr(built, "aggregate", None))):
            raise PluginError(
                f"metric '{name}' ({label}): factory returned {type(built).__name__}, "
                "expected an object with score() and aggregate()",
                plugin=plugin,
            )
        return PluginMetric(built, name, plugin, label)

    def safe_score(self, metric: Metric, record: Mapping[str, Any], row: Mapping[str, Any]) -> Scores:
        """Score one record; any failure becomes a :class:`PluginError` naming the plugin.

        Metrics from :meth:`build_metric` already behave this way; this also covers a metric
        object built some other way. The pipeline is expected to catch the error, store its
        message in the record's ``error`` (keeping the generations) and go on with the run.
        """
        if isinstance(metric, PluginMetric):
            return metric.score(record, row)
        name = getattr(metric, "name", type(metric).__name__)
        return PluginMetric(metric, name, name, f"metric object {type(metric).__name__}").score(record, row)

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
                    f"{self._label(plugin_name)} failed in {hook_name}: {type(exc).__name__}: {exc}",
                    plugin=plugin_name,
                ) from exc

    # -- listing -------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One entry per loaded plugin, in registration order, for ``batchgen plugins``.

        Each entry has ``name``, ``source`` ("built-in", "entry point" or "module"), ``module``,
        ``distribution`` and ``version`` (None unless loaded from an entry point), ``samplers`` and
        ``metrics`` (the names it registered, each ``{"name", "description", "options"}``, the
        options as :func:`describe_options` lists them) and ``hooks`` (the lifecycle hooks it
        implements).
        """
        entries = []
        for plugin_name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # a blocked name
                continue
            info = self._infos.get(plugin_name, _PluginInfo(plugin_name, "module"))
            hooks = sorted(
                caller.name for caller in self.pm.get_hookcallers(plugin) or () if caller.name in LIFECYCLE_HOOKS
            )
            entries.append(
                {
                    "name": plugin_name,
                    "source": info.source,
                    "module": getattr(plugin, "__name__", type(plugin).__name__),
                    "distribution": info.distribution,
                    "version": info.version,
                    "samplers": [
                        {"name": n, "description": s.description, "options": describe_options(s.options_model)}
                        for n, s in self.samplers.items()
                        if self._owners[("sampler", n)] == plugin_name
                    ],
                    "metrics": [
                        {"name": n, "description": m.description, "options": describe_options(m.options_model)}
                        for n, m in self.metrics.items()
                        if self._owners[("metric", n)] == plugin_name
                    ],
                    "hooks": hooks,
                }
            )
        return entries


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


def _load_entry_points(pm: pluggy.PluginManager, infos: dict[str, _PluginInfo]) -> None:
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
        if pm.get_plugin(ep.name) is not None:
            first = infos.get(ep.name)
            if first is not None and first.distribution == dist_name:
                continue  # the same distribution seen twice on sys.path, as pluggy does
            raise PluginError(
                f"{what} clashes with {first.label if first else repr(ep.name)}: two plugins "
                "with one name; uninstall one of them",
                plugin=ep.name,
            )
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"{what} has an invalid hook implementation: {_one_line(exc)}", plugin=ep.name
            ) from exc
        except Exception as exc:
            raise PluginError(
                f"{what} failed to load: {type(exc).__name__}: {exc}", plugin=ep.name
            ) from exc
        infos[ep.name] = _PluginInfo(ep.name, "entry point", dist_name, dist_version)


def _load_module(pm: pluggy.PluginManager, module_name: str, infos: dict[str, _PluginInfo]) -> None:
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
    infos[module_name] = _PluginInfo(module_name, "module")


def load_registry(extra_modules: Sequence[str] = ()) -> PluginRegistry:
    """Build a :class:`PluginRegistry` from the built-ins, the entry points and ``extra_modules``.

    Args:
        extra_modules: Importable module names from the config's ``plugins`` list. A module that
            is also an installed entry point is registered once.

    Raises:
        PluginError: a module that is missing or fails to import, an entry point that fails to
            load, an invalid or misspelt hook implementation, a malformed spec or two plugins
            registering the same name; each message names the plugin.
    """
    if isinstance(extra_modules, str):
        extra_modules = (extra_modules,)
    # Imported here, not at module level: the built-ins import the hookimpl marker from this
    # package, whose __init__ imports this module.
    from batchgen.plugins import builtin_metrics, builtin_samplers

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    infos: dict[str, _PluginInfo] = {}
    for module, name in ((builtin_samplers, BUILTIN_SAMPLERS_PLUGIN), (builtin_metrics, BUILTIN_METRICS_PLUGIN)):
        _register(pm, module, name, f"built-in plugin '{name}'")
        infos[name] = _PluginInfo(name, "built-in")
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


__all__ = [
    "ENTRY_POINT_GROUP",
    "describe_options",
    "GuardedProcessor",
    "GuardedStatefulProcessor",
    "PluginError",
    "PluginMetric",
    "PluginRegistry",
    "load_registry",
]
