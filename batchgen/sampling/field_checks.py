"""The checks the generation parameters' fields share (:mod:`batchgen.sampling.params`):
integers and numbers in range, booleans, stop strings and ids, the token budget, logits
processors. Each raises ``ValueError`` naming the field and what it takes.

Torch-free, as the parameters are: the scheduler and the config loader read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["SEED_MAX", "SEED_MIN", "LogitsProcessor", "check_bool", "check_float", "check_int", "check_processors",
           "check_tokens", "is_stateful", "normalise_stop", "normalise_stop_token_ids"]

#: A logits processor: ``proc(logits[rows, vocab] float32, output_token_ids per row) -> logits``.
#: It runs after penalties and temperature and before top-k / top-p / min-p; masking is done by
#: setting ``-inf``. Typed loosely here because this module may not import torch. A stateful
#: processor (:class:`batchgen.plugins.StatefulLogitsProcessor`) may stand in the same lists.
LogitsProcessor = Callable[[Any, list[list[int]]], Any]


def is_stateful(proc: object) -> bool:
    """Whether ``proc`` follows the stateful contract (it has ``new_state``), as
    :class:`batchgen.plugins.StatefulLogitsProcessor` does; duck-typed, so that this torch-free
    module need not import the plugin package."""
    return callable(getattr(proc, "new_state", None))


def check_processors(value: Iterable[Any] | None) -> list[Any]:
    """``logits_processors`` as a list; raises unless each is callable or stateful."""
    procs = list(value or [])
    for proc in procs:
        if not (callable(proc) or is_stateful(proc)):
            raise ValueError(
                f"logits_processors must hold callables proc(logits, output_token_ids) -> logits "
                f"or stateful processors (with new_state), got {proc!r}")
    return procs


# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def check_int(name: str, value: object, *, minimum: int | None = None,
               maximum: int | None = None, allowed: str) -> None:
    """Raise unless ``value`` is an int (not a bool) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer ({allowed}), got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_float(name: str, value: object) -> float:
    """Raise unless ``value`` is a finite real number; return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_bool(name: str, value: object) -> None:
    """Raise unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def normalise_stop(value: str | Iterable[str] | None) -> list[str]:
    """``stop`` accepts one string, a list of strings, or None; returns a list of non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    for s in items:
        if not isinstance(s, str) or s == "":
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {s!r}")
    return items


def normalise_stop_token_ids(value: int | Iterable[int] | None) -> list[int]:
    """``stop_token_ids`` accepts one id, a list of ids, or None; returns a list of ids >= 0."""
    if value is None:
        return []
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value)
    for t in items:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {t!r}")
    return items


def check_tokens(max_tokens: object, min_tokens: object, scoring: bool = False) -> None:
    """``scoring``: ``max_tokens=0`` is allowed too, and None (up to the context limit; the
    caller checks what it needs)."""
    if not (scoring and max_tokens is None):
        check_int("max_tokens", max_tokens, minimum=0 if scoring else 1,
                   allowed=">= 1, or None for up to the context limit (0 scores the prompt only, "
                   "with prompt_logprobs)" if scoring else ">= 1")
    check_int("min_tokens", min_tokens, minimum=0, allowed=">= 0")
    assert isinstance(min_tokens, int)
    if isinstance(max_tokens, int) and min_tokens > max_tokens:
        raise ValueError(
            f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")
