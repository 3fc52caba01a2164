"""Request and output records of the public API (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from batchgen.engine.sequence import RequestStats

Prompt = Union[str, list[int]]


@dataclass
class Request:
    """One unit of work for ``LLM.stream``.

    Attributes:
        request_id: unique within a run; echoed on the output.
        prompt: text (tokenised with the model's tokenizer) or token ids.
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
