"""Loading a run config: read the YAML (safely), apply ``--set``, validate into a
:class:`~batchgen.config.run_config.RunConfig` (plugins too, given a registry), and dump the
resolved config.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from batchgen.config.errors import ConfigError, ConfigIssue
from batchgen.config.messages import issue
from batchgen.config.overrides import apply_overrides
from batchgen.config.run_config import RunConfig


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping safely; problems raise :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", f"config file not found: {path}")]) from None
    except OSError as exc:
        raise ConfigError([ConfigIssue("", f"cannot read config file {path}: {exc.strerror}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue("", f"YAML syntax error{where}: {problem}")], str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue("", f"the top level must be a mapping of sections, got {type(data).__name__}")],
            str(path),
        )
    return data


def validate_config(data: Mapping[str, Any], registry: Any = None, source: str | None = None) -> RunConfig:
    """Validate a raw mapping into a :class:`RunConfig`, raising one :class:`ConfigError` with all issues."""
    try:
        return RunConfig.model_validate(dict(data), context={"registry": registry})
    except ValidationError as exc:
        raise ConfigError([issue(err) for err in exc.errors()], source) from None


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    registry: Any = None,
) -> RunConfig:
    """Read ``path``, apply ``--set`` overrides and validate (plugins too, given a registry)."""
    data = apply_overrides(read_yaml(path), overrides)
    return validate_config(data, registry=registry, source=str(path))


def plugin_modules(path: str | Path, overrides: Sequence[str] = ()) -> list[str]:
    """The ``plugins:`` list of a config, read before full validation.

    The registry must be built (importing these modules) before plugin names can be checked,
    so this peeks at the raw list. A malformed value yields ``[]``; full validation reports it.
    """
    data = apply_overrides(read_yaml(path), overrides)
    modules = data.get("plugins")
    if isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        return list(modules)
    return []




def resolved_dict(config: RunConfig, registry: Any = None) -> dict[str, Any]:
    """The fully resolved config (defaults filled in) as plain JSON-able data.

    With a plugin registry (duck-typed as in :func:`validate_config`), plugin options get their
    defaults filled in too, and each metric's ``label`` is set to the key its scores live under.
    """
    data = config.model_dump(mode="json")
    for ref, dumped in zip(config.metrics, data["metrics"]):
        dumped["label"] = ref.key
        dumped["options"] = _resolved_options(registry, "metric", ref.name, ref.options)
    sampler = config.generation.sampler
    if sampler is not None:
        data["generation"]["sampler"]["options"] = _resolved_options(registry, "sampler", sampler.name, sampler.options)
    return data


def _resolved_options(registry: Any, kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A plugin's options with its defaults filled in, or as given when that is not possible."""
    if registry is None:
        return dict(options)
    # deferred: the plugins package (pluggy, the built-ins; ~0.5 s) only with a registry
    from batchgen.plugins.errors import PluginError

    try:
        return registry.resolve(kind, name).spec.options_model.model_validate(options).model_dump(mode="json")
    except (PluginError, ValidationError, TypeError, ValueError):
        return dict(options)
