"""StructuredOutputsParams: a constraint on the generated text (vLLM's names), and the rule
that ties it to the other parameters of a request (:func:`check_structured`).

Torch-free and free of the grammar library: only the constraint's shape is checked here;
whether it compiles is :func:`batchgen.structured.check`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["STRUCTURED_KINDS", "StructuredOutputsParams", "check_structured"]

#: The fields of :class:`StructuredOutputsParams` that name a constraint, in the order they are
#: reported.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names); exactly one field is set.

    * ``json``: a JSON schema, as a mapping or as JSON text; the output is one JSON value that
      validates against it.
    * ``regex``: the output fully matches this regular expression.
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: an EBNF grammar (the grammar library's dialect, GBNF-like, ``root`` rule
      first); the output is a sentence of it.
    * ``json_object``: True: the output is any JSON object.

    Only the shape is checked here (this module stays free of the grammar library); whether a
    schema, regex or grammar compiles is checked by :func:`batchgen.structured.check`, which the
    config loader and the engine call.
    """

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be True or False, got {self.json_object!r}")
        given = [k for k in STRUCTURED_KINDS
                 if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                + ("none was given" if not given else "got " + ", ".join(given)))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json must be a JSON schema (a mapping or JSON text): {exc}") from None
                if not isinstance(parsed, dict):
                    raise ValueError("json must be a JSON schema object, got JSON "
                                     f"{type(parsed).__name__}")
            elif not isinstance(self.json, Mapping):
                raise ValueError(f"json must be a JSON schema (a mapping or JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise ValueError("choice must be a list of strings, got one string")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which field is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in STRUCTURED_KINDS
                    if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    @property
    def key(self) -> str:
        """A canonical text naming the constraint: equal constraints (a schema given as a
        mapping or as text with other spacing or key order) have equal keys; compiled grammars
        are cached under it."""
        kind = self.kind
        value: Any = True if kind == "json_object" else getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_structured(value: object, min_tokens: int, ignore_eos: bool) -> StructuredOutputsParams | None:
    """A request's ``structured_outputs`` (a mapping becomes a StructuredOutputsParams), or None;
    refused beside ``ignore_eos`` or ``min_tokens``."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = StructuredOutputsParams(**dict(value))
    if not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {value!r}")
    # The constraint decides where the output may end: EOS is allowed exactly there.
    if ignore_eos:
        raise ValueError("structured_outputs cannot be combined with ignore_eos: the constraint "
                         "decides where the output ends")
    if min_tokens:
        raise ValueError("structured_outputs cannot be combined with min_tokens: the constraint "
                         "decides where the output ends")
    return value
