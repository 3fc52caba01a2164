"""A plugin's options model, read for messages and listings: every field error on one line each
(:func:`format_validation_error`) and every option with its type, bounds and default
(:func:`describe_options`, what ``batchgen plugins`` prints).

This module imports nothing heavy.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from batchgen.suggest import did_you_mean


def format_validation_error(error: ValidationError, model: type[BaseModel]) -> list[str]:
    """One ``field: message (got value)`` line per pydantic error, with did-you-mean for extras."""
    fields = list(model.model_fields)
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(options)"
        line = f"{loc}: {item['msg']}"
        if item["type"] == "extra_forbidden":
            line = f"{loc}: unknown option"
            line += did_you_mean(str(item["loc"][0]), fields) if item["loc"] else ""
            line += f". Allowed options: {', '.join(fields)}." if fields else ". This takes no options."
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
