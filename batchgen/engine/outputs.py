"""Request and output records of the public API (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from batchgen.engine.sequence import RequestStats

#: A request's prompt: text, token ids, or one of vLLM's prompt dicts (see
#: :mod:`batchgen.engine.prompts`).
Prompt = Union[str, list[int], dict[str, Any]]


@dataclass
class Request:
    """One unit of work for ``LLM.stream``.

    Attributes:
        request_id: unique within a run; echoed on the output.
        prompt: text (tokenised with the model's tokenizer), token ids, ``{"prompt": text}``
            or ``{"prompt_token_ids": ids}`` (see :mod:`batchgen.engine.prompts`).
        params: a SamplingParams or a BeamSearchParams.
        lora_request: a ``batchgen.lora.LoRARequest`` to run under, or None (the base model).
    """

    request_id: str
    prompt: Prompt
    params: Any
    lora_request: Any = None


@dataclass
class Logprob:
    """One token's entry in ``RequestOutput.prompt_logprobs`` (vLLM's ``Logprob``).

    ``logprob`` is the log-softmax of the model's raw logits; ``rank`` is 1 for the most
    likely token (1 + the number of tokens with a larger logit); ``decoded_token`` is the
    token decoded on its own.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: ``RequestOutput.prompt_logprobs``: None for the first prompt token (and any before
#: ``prompt_logprobs_start``), then ``{token_id: Logprob}`` per prompt token.
PromptLogprobs = list[Union[dict[int, Logprob], None]]


@dataclass
class CompletionOutput:
    """One generated sequence.

    ``token_ids`` and ``text`` exclude the token or string that stopped generation.
    ``logprobs`` is None unless asked for; then one ``{token_id: logprob}`` per token, holding
    the chosen token and the top alternatives. ``score`` is the beam score (beam search only).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    score: float | None = None


@dataclass
class RequestOutput:
    """The result of one request: its completions, or an error that failed only it.

    ``prompt_logprobs`` is None unless the request's ``SamplingParams.prompt_logprobs`` asked
    for it (see :data:`PromptLogprobs`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class BeamSearchSequence:
    """One beam of :meth:`batchgen.LLM.beam_search` (vLLM's names): ``tokens`` are the
    prompt's and the beam's, ``text`` their decoded text; ``score`` is the length-penalised
    score the beams are ranked by."""

    tokens: list[int]
    text: str | None = None
    cum_logprob: float = 0.0
    score: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt of :meth:`batchgen.LLM.beam_search`, best first."""

    sequences: list[BeamSearchSequence]

    @classmethod
    def of(cls, output: RequestOutput, tokenizer: Any, skip_special_tokens: bool = True) -> BeamSearchOutput:
        """The beams of a beam-search request's output, best score first, each with the
        prompt's tokens before its own and their decoded text (as vLLM's)."""
        def rank(c: CompletionOutput) -> float:
            return c.score if c.score is not None else c.cumulative_logprob or 0.0

        sequences = []
        for c in sorted(output.outputs, key=rank, reverse=True):
            tokens = list(output.prompt_token_ids) + list(c.token_ids)
            sequences.append(BeamSearchSequence(
                tokens=tokens, text=tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens),
                cum_logprob=c.cumulative_logprob or 0.0, score=c.score,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return cls(sequences=sequences)


@dataclass
class EngineStats:
    """Run-level counters of the engine (see docs/architecture.md).

    Prompt tokens: ``num_prompt_tokens`` arrived; ``prefix_cache_hits`` of the
    ``prefix_cache_queries`` looked up were served from the prefix cache (in
    ``prefix_cache_hit_blocks`` blocks); ``num_prefill_tokens`` were computed (every token
    computed other than a decode, so recomputation after preemption counts again).
    """

    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    peak_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_cow_copies: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_prefill_tokens: int
    num_steps: int
    physical_blocks: int
    logical_blocks: int
    prefix_cache_hit_blocks: int = 0
    num_evictions: int = 0
    num_released_blocks: int = 0  # released behind a sliding window (a model whose every layer slides)

    @property
    def saving(self) -> float:
        """Sharing saving over finished requests: 1 - physical / logical blocks."""
        return 1.0 - self.physical_blocks / self.logical_blocks if self.logical_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["saving"] = self.saving
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
