"""``--set a.b=value`` overrides, applied to the raw mapping before validation; the value is
parsed with ``yaml.safe_load`` (``--set data.limit=5`` gives an int, ``=null`` gives None).

This module imports nothing heavy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import yaml

from batchgen.config.errors import ConfigError, ConfigIssue


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value`` into (``["a", "b"]``, value parsed as YAML).

    Raises :class:`ConfigError` for text without ``=`` or with an empty key.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError([ConfigIssue("--set", f"expected KEY.PATH=VALUE, got '{text}'")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(key, f"--set value is not valid YAML: {exc}")]) from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override applied.

    Missing mappings on the way are created; a numeric part indexes into an existing list
    (``metrics.0.name=contains``). Unknown keys are left for the schema to reject, so they get
    the same did-you-mean as keys in the file.
    """
    result = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = result
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        [ConfigIssue(where, f"--set: no list item {part} (the list has {len(node)})")]
                    )
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            else:
                parent = ".".join(parts[:i])
                raise ConfigError([ConfigIssue(where, f"--set: '{parent}' is not a mapping")])
    return result
