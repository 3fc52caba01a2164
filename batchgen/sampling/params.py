"""Validated generation parameters, with vLLM's field names: :class:`SamplingParams` and
:class:`BeamSearchParams`. Their fields' shared checks are :mod:`batchgen.sampling.field_checks`;
the structured-output constraint they may carry is
:mod:`batchgen.sampling.structured_params` (its names are re-exported here).

This module is part of the engine core and must not import torch: the scheduler, the sequence
bookkeeping and the config loader all read these objects.

Both dataclasses validate themselves in ``__post_init__`` and raise ``ValueError`` (also for a
value of the wrong type, so that callers such as pydantic validators need to catch only one
exception type) with a message that names the field and its allowed range, so a bad request
fails when it is built rather than in the middle of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from batchgen.sampling.field_checks import (
    SEED_MAX, SEED_MIN, LogitsProcessor, check_bool, check_float, check_int, check_processors, check_tokens,
    is_stateful, normalise_stop, normalise_stop_token_ids,
)
from batchgen.sampling.structured_params import STRUCTURED_KINDS, StructuredOutputsParams, check_structured

__all__ = ["SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "LogitsProcessor",
           "is_stateful", "STRUCTURED_KINDS"]


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
    * ``max_tokens`` (>= 1, default 16; None: up to the context limit, as in vLLM),
      ``min_tokens`` (0..max_tokens): EOS and stop ids are suppressed until ``min_tokens``
      tokens have been generated. Generation always ends at the model's length
      (``max_model_len``) with ``finish_reason="length"``. ``max_tokens=0`` scores the prompt
      only (it needs ``prompt_logprobs``, and ``n=1``): no token is generated and the
      completion ends with ``finish_reason="length"``.
    * ``ignore_eos``: keep generating after EOS (until ``max_tokens`` or a stop condition).
    * ``logprobs`` (None or >= 0): number of top alternatives reported per token besides the
      chosen one; 0 reports only the chosen token. Reported values are log-softmax of the raw
      model logits (before penalties and temperature), as vLLM does by default.
    * ``prompt_logprobs`` (None or >= 0): fill ``RequestOutput.prompt_logprobs`` as vLLM does:
      None for the first prompt token, then per prompt token ``{token_id: Logprob}`` with the
      token's own entry and the ``prompt_logprobs`` most likely tokens (0: the token's entry
      only). The positions that score them are computed even where the prefix cache holds
      their K/V.
    * ``prompt_logprobs_start`` (None or >= 1, batchgen's): the first prompt position scored
      (None: 1); earlier entries are None, and the prefix cache serves the whole blocks
      before position ``prompt_logprobs_start - 1``. ``LLM.loglikelihood`` sets it to the
      context's length, so that only the continuation is scored.
    * ``skip_special_tokens``: drop special tokens when detokenising.
    * ``include_stop_str_in_output``: the text ends with the stop string that ended it
      (default: cut before it). Stop token ids and EOS never reach the text.
    * ``detokenize``: False leaves every completion's ``text`` empty (token ids only); it
      cannot be combined with stop strings, which match the text.
    * ``logits_processors``: callables, see :data:`LogitsProcessor`, or stateful processors
      (:class:`batchgen.plugins.StatefulLogitsProcessor`).
    * ``structured_outputs``: a :class:`StructuredOutputsParams` constraint, or None.
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
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_int("n", self.n, minimum=1, allowed=">= 1")
        if self.best_of is not None:
            check_int("best_of", self.best_of, minimum=self.n,
                       allowed=f">= n ({self.n})")
        if self.best_of_ranking not in ("sum", "mean"):
            raise ValueError(
                f"best_of_ranking must be 'sum' or 'mean', got {self.best_of_ranking!r}")
        self.temperature = check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        self.top_p = check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, minimum=-1,
                   allowed="0 or -1 (disabled), or >= 1")
        self.min_p = check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            check_int("seed", self.seed, minimum=SEED_MIN, maximum=SEED_MAX,
                       allowed=f"an integer in [{SEED_MIN}, {SEED_MAX}]")
        self.stop = normalise_stop(self.stop)
        self.stop_token_ids = normalise_stop_token_ids(self.stop_token_ids)
        check_tokens(self.max_tokens, self.min_tokens, scoring=True)
        check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, minimum=0,
                       allowed=">= 0 (number of alternatives besides the chosen token)")
        self._check_prompt_logprobs()
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they match the text); use "
                             "stop_token_ids with detokenize=False")
        self.logits_processors = check_processors(self.logits_processors)
        self.structured_outputs = check_structured(self.structured_outputs, self.min_tokens, self.ignore_eos)

    def _check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, minimum=0,
                       allowed=">= 0 (number of alternatives besides the prompt token)")
        if self.prompt_logprobs_start is not None:
            if self.prompt_logprobs is None:
                raise ValueError("prompt_logprobs_start needs prompt_logprobs (the number of "
                                 "alternatives to report, 0 for none)")
            check_int("prompt_logprobs_start", self.prompt_logprobs_start, minimum=1,
                       allowed=">= 1 (the first prompt position scored)")
        if self.max_tokens == 0:
            if self.prompt_logprobs is None:
                raise ValueError("max_tokens must be >= 1 to generate; max_tokens=0 scores the "
                                 "prompt only and needs prompt_logprobs (0 for the prompt "
                                 "tokens' own logprobs)")
            if self.num_sequences != 1:
                raise ValueError(f"max_tokens=0 (scoring the prompt) takes n=1 and no best_of, "
                                 f"got n={self.n}, best_of={self.best_of}")

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
    * ``structured_outputs``: as in :class:`SamplingParams`: beams rank only the continuations
      the constraint allows, and a beam may end (EOS) only where it accepts.
    * ``logits_processors``: as in :class:`SamplingParams`; on beams they act on each beam's
      log-softmax scores (as HF's beam search applies its processors), so a processor that
      masks (``-inf``) removes candidates without renormalising the others.
    * ``temperature`` and ``include_stop_str_in_output``: vLLM's fields, accepted with their
      default (0 and False) only.
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
    structured_outputs: StructuredOutputsParams | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    temperature: float = 0.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, minimum=1, allowed=">= 1")
        if check_float("temperature", self.temperature) != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (beams rank the model's own "
                             f"log-probabilities, as HF's beam search does), got {self.temperature}")
        if self.include_stop_str_in_output is not False:
            raise ValueError("include_stop_str_in_output is not supported for beam search: a beam's "
                             "text ends before its stop string")
        check_tokens(self.max_tokens, self.min_tokens)
        self.length_penalty = check_float("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        check_int("num_return_sequences", self.num_return_sequences, minimum=1,
                   maximum=self.beam_width, allowed=f"in [1, beam_width ({self.beam_width})]")
        self.stop = normalise_stop(self.stop)
        self.stop_token_ids = normalise_stop_token_ids(self.stop_token_ids)
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        self.structured_outputs = check_structured(self.structured_outputs, self.min_tokens, self.ignore_eos)
        self.logits_processors = check_processors(self.logits_processors)
