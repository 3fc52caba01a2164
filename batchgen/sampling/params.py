"""Validated generation parameters, with vLLM's field names.

This module is part of the engine core and must not import torch: the scheduler, the sequence
bookkeeping and the config loader all read these objects.

Both dataclasses validate themselves in ``__post_init__`` and raise ``ValueError`` (also for a
value of the wrong type, so that callers such as pydantic validators need to catch only one
exception type) with a message that names the field and its allowed range, so a bad request
fails when it is built rather than in the middle of a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

__all__ = ["SamplingParams", "BeamSearchParams", "LogitsProcessor"]

#: A logits processor: ``proc(logits[rows, vocab] float32, output_token_ids per row) -> logits``.
#: It runs after penalties and temperature and before top-k / top-p / min-p; masking is done by
#: setting ``-inf``. Typed loosely here because this module may not import torch.
LogitsProcessor = Callable[[Any, list[list[int]]], Any]

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _check_int(name: str, value: object, *, minimum: int | None = None,
               maximum: int | None = None, allowed: str) -> None:
    """Raise unless ``value`` is an int (not a bool) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer ({allowed}), got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object) -> float:
    """Raise unless ``value`` is a finite real number; return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _normalise_stop(value: str | Iterable[str] | None) -> list[str]:
    """``stop`` accepts one string, a list of strings, or None; returns a list of non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    for s in items:
        if not isinstance(s, str) or s == "":
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {s!r}")
    return items


def _normalise_stop_token_ids(value: int | Iterable[int] | None) -> list[int]:
    """``stop_token_ids`` accepts one id, a list of ids, or None; returns a list of ids >= 0."""
    if value is None:
        return []
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value)
    for t in items:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {t!r}")
    return items


def _check_tokens(max_tokens: object, min_tokens: object) -> None:
    _check_int("max_tokens", max_tokens, minimum=1, allowed=">= 1")
    _check_int("min_tokens", min_tokens, minimum=0, allowed=">= 0")
    assert isinstance(max_tokens, int) and isinstance(min_tokens, int)
    if min_tokens > max_tokens:
        raise ValueError(
            f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")


@dataclass
class SamplingParams:
    """Parameters of one sampled (or greedy) request.

    Fields (vLLM's names and defaults):

    * ``n`` (>= 1): number of completions returned.
    * ``best_of`` (None or >= n): generate ``best_of`` sequences and return the ``n`` best,
      ranked by ``best_of_ranking``: ``"sum"`` (cumulative logprob) or ``"mean"`` (cumulative
      logprob / number of generated tokens). None means ``n``.
    * ``temperature`` (>= 0): 0 means greedy.
    * ``top_p`` (0 < top_p <= 1), ``top_k`` (0 or -1 = off, else >= 1), ``min_p`` (0..1).
    * ``repetition_penalty`` (> 0, 1 = off): HF semantics over prompt + output tokens: a
      positive logit is divided by it, a negative one multiplied.
    * ``presence_penalty`` / ``frequency_penalty`` (-2..2, 0 = off): OpenAI semantics over the
      output tokens only: subtract ``presence * [count > 0] + frequency * count``.
    * ``seed``: per-request seed; None uses the engine's global generator.
    * ``stop`` (strings) and ``stop_token_ids``: end the completion; neither is emitted.
    * ``max_tokens`` (>= 1), ``min_tokens`` (0..max_tokens): EOS and stop ids are suppressed
      until ``min_tokens`` tokens have been generated.
    * ``ignore_eos``: keep generating after EOS (until ``max_tokens`` or a stop condition).
    * ``logprobs`` (None or >= 0): number of top alternatives reported per token besides the
      chosen one; 0 reports only the chosen token. Reported values are log-softmax of the raw
      model logits (before penalties and temperature), as vLLM does by default.
    * ``skip_special_tokens``: drop special tokens when detokenising.
    * ``logits_processors``: callables, see :data:`LogitsProcessor`.
    """

    n: int = 1
    best_of: int | None = None
    best_of_ranking: Literal["sum", "mean"] = "sum"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1, allowed=">= 1")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, minimum=self.n,
                       allowed=f">= n ({self.n})")
        if self.best_of_ranking not in ("sum", "mean"):
            raise ValueError(
                f"best_of_ranking must be 'sum' or 'mean', got {self.best_of_ranking!r}")
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1,
                   allowed="0 or -1 (disabled), or >= 1")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=_SEED_MIN, maximum=_SEED_MAX,
                       allowed=f"an integer in [{_SEED_MIN}, {_SEED_MAX}]")
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_tokens(self.max_tokens, self.min_tokens)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0,
                       allowed=">= 0 (number of alternatives besides the chosen token)")
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.logits_processors is None:
            self.logits_processors = []
        self.logits_processors = list(self.logits_processors)
        for proc in self.logits_processors:
            if not callable(proc):
                raise ValueError(
                    f"logits_processors must hold callables "
                    f"proc(logits, output_token_ids) -> logits, got {proc!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the choice is deterministic argmax: ``temperature == 0`` or ``top_k == 1``.

        Penalties and logits processors still apply before the argmax.
        """
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated: ``best_of`` if set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class BeamSearchParams:
    """Parameters of one beam-search request, with HF transformers' semantics.

    * ``beam_width`` (>= 1): number of live beams (HF ``num_beams``).
    * ``max_tokens`` (>= 1): maximum number of generated tokens (HF ``max_new_tokens``).
    * ``length_penalty`` (finite): a finished hypothesis scores
      ``sum_logprobs / generated_length ** length_penalty``.
    * ``early_stopping``: True stops once ``beam_width`` hypotheses are finished; False stops
      when no live beam can beat the worst kept hypothesis under HF's heuristic; ``"never"``
      uses the exact bound.
    * ``num_return_sequences`` (1..beam_width): None means ``beam_width``; it is resolved to an
      int in ``__post_init__``.
    * ``min_tokens`` (0..max_tokens), ``stop_token_ids``, ``stop`` (strings), ``ignore_eos``,
      ``skip_special_tokens``: as in :class:`SamplingParams`.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    num_return_sequences: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, minimum=1, allowed=">= 1")
        _check_tokens(self.max_tokens, self.min_tokens)
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1,
                   maximum=self.beam_width, allowed=f"in [1, beam_width ({self.beam_width})]")
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
