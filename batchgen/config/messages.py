"""Pydantic's errors in YAML's words: one :class:`~batchgen.config.errors.ConfigIssue` per
error, with the key path ``--set`` accepts, did-you-mean for unknown keys and choices, and what a
key takes when a value has the wrong type.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel

from batchgen.config.errors import ConfigIssue, quoted
from batchgen.config.run_config import RunConfig
from batchgen.suggest import did_you_mean


def _unwrap_model(annotation: Any) -> Any:
    """The pydantic model (or Literal) inside Optional[...] / list[...] / dict[...] wrappers."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, dict, Sequence):
        for arg in typing.get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
        return None
    if origin is Literal:
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _walk(loc: Sequence[Any]) -> Any:
    """Follow a pydantic error location from RunConfig; return the model/Literal found there."""
    node: Any = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return None
        field = node.model_fields.get(part)
        if field is None:
            return None
        node = _unwrap_model(field.annotation)
    return node


#: Strict type errors -> what the key takes, in YAML's words.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "text",
}


def _yaml_text(value: Any) -> str:
    """``value`` as it reads in YAML: true, null, 8, 'text'."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return str(value)


def _type_message(kind: str, value: Any) -> str:
    """``expected an integer, got true`` plus the fix when it is obvious."""
    message = f"expected {_EXPECTED[kind]}, got {_yaml_text(value)}"
    if isinstance(value, str) and kind != "string_type":
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = None
        if kind == "bool_type" and isinstance(parsed, bool):
            return message + f"; write {_yaml_text(parsed)} without quotes"
        if kind in ("int_type", "float_type") and isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
            if kind == "float_type" or isinstance(parsed, int):
                return message + f"; write {parsed} without quotes"
    if kind == "int_type" and isinstance(value, float) and value.is_integer():
        return message + f"; write {int(value)}"
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return message + "; a boolean is not a number"
    if kind == "string_type" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return message + f"; quote it: '{value}'"
    return message


def issue(err: Mapping[str, Any]) -> ConfigIssue:
    """Turn one pydantic error into a :class:`ConfigIssue` with a friendlier message."""
    # Pydantic adds the name of a model-validator step ('function-after[...]') to some locations.
    loc = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        parent = _walk(loc[:-1])
        valid = [f.alias or k for k, f in parent.model_fields.items()] if parent is not None else []
        message = f"unknown key{did_you_mean(str(loc[-1]), valid)}"
        if valid:
            message += f"; valid keys here: {quoted(valid)}"
        return ConfigIssue(path, message)
    if kind == "missing":
        return ConfigIssue(path, "required key is missing")
    if kind == "literal_error":
        literal = _walk(loc)
        choices = [str(c) for c in typing.get_args(literal)] if literal is not None else []
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return ConfigIssue(path, f"invalid value {value!r}{hint}; valid: {quoted(choices)}")
    if kind == "value_error":
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        return ConfigIssue(path, message)
    if kind in _EXPECTED:
        return ConfigIssue(path, _type_message(kind, value))
    message = err["msg"]
    if not isinstance(value, (dict, list)) or kind.endswith("_type"):
        shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
        message += f" (got {shown})"
    return ConfigIssue(path, message)
