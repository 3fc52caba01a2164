"""The job a command runs: read from its ``CONFIG`` file (``run``, ``validate``) or built from
``batch``'s flags, with ``--set`` applied, its plugins loaded and validated against them; and
how a setup error names the file it came from.

Each function defers the config and plugin stacks (pydantic, yaml, pluggy; about 1 s), so that
``batchgen --help`` and the commands that read no config start fast.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["batch_config", "files", "in_file", "load", "validated", "with_if_exists"]


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """Read the YAML once, build the plugin registry from its ``plugins:`` and validate it
    (raises SETUP_ERRORS)."""
    # deferred (start-up): the config stack (pydantic, yaml; ~0.7 s) only for the commands that read one
    from batchgen.config import apply_overrides, read_yaml

    return validated(apply_overrides(read_yaml(args.config), args.overrides), str(args.config))


def validated(data: dict[str, Any], source: str) -> tuple[Any, Any]:
    """The registry of ``data``'s plugin modules, and ``data`` validated against it."""
    # deferred (start-up): the config and plugin stacks (pydantic, pluggy; ~1 s) only when a config is read
    from batchgen.config import validate_config
    from batchgen.plugins import load_registry

    modules = data.get("plugins") if isinstance(data.get("plugins"), list) else []
    registry = load_registry([m for m in modules if isinstance(m, str)])
    return registry, validate_config(data, registry=registry, source=source)


def batch_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """The job of ``batchgen batch``: a config built from its flags, then ``--set`` applied."""
    # deferred (start-up): the config stack (~0.7 s) only when a config is read
    from batchgen.config import ConfigError, ConfigIssue, apply_overrides

    output: dict[str, Any] = {"path": args.output, "format": "openai_batch"}
    if args.error_file:
        output["error_path"] = args.error_file
    raw: dict[str, Any] = {"data": {"source": args.input, "format": "openai_batch"}, "output": output}
    targets, aliases = [], []
    for spec in args.models:
        name, sep, target = spec.partition("=")
        if sep and not (name and target):
            raise ConfigError([ConfigIssue("--model", f"expected MODEL or NAME=MODEL, got '{spec}'")])
        targets.append(target if sep else name)
        aliases += [name] if sep else []
    if len(set(targets)) > 1:
        raise ConfigError([ConfigIssue("--model", f"one job runs one model; got {', '.join(sorted(set(targets)))}")])
    if targets:
        raw["model"] = {"name": targets[0], "aliases": aliases}
    loras = [spec.partition("=") for spec in args.loras]
    bad = [f"{n}{s}{p}" for n, s, p in loras if not (n and s and p)]
    if bad:
        raise ConfigError([ConfigIssue("--lora", f"expected NAME=PATH, got '{bad[0]}'")])
    if loras:
        raw.setdefault("model", {})["adapters"] = {name: path for name, _, path in loras}
    return validated(apply_overrides(raw, args.overrides), "batchgen batch")


def with_if_exists(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with ``--resume`` / ``--overwrite`` as its ``output.if_exists``: a copy, the
    validated config itself is left as it is."""
    if args.resume or args.force_resume:
        if_exists = "resume"
    elif args.overwrite:
        if_exists = "overwrite"
    else:
        return config
    return config.model_copy(update={"output": config.output.model_copy(update={"if_exists": if_exists})})


def in_file(error: Exception, source: str) -> str:
    """The message of a setup error; a config error found after validation (a missing column,
    a model that is not there) gets the config file's name in front, as every config error does."""
    # deferred (start-up): the config stack (~0.7 s) only for a setup error
    from batchgen.config import ConfigError

    if isinstance(error, ConfigError) and error.source is None:
        return str(ConfigError(error.issues, source))
    return str(error)


def files(config: Any) -> str:
    """The record file(s) of a run, for messages."""
    if config.output.error_path:
        return f"{config.output.path} and {config.output.error_path}"
    return str(config.output.path)
