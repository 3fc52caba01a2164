"""Sequence and SequenceGroup: the engine's per-request state (pure Python, no torch).

A *sequence* is one token stream with its own block table. A *sequence group* is everything
one request owns: one sequence while the prompt is prefilled, then its n samples (or best_of)
or its beams, forked from the prompt's sequence so that they share its blocks. Groups are
scheduled, preempted and finished as a whole.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence. WAITING: not admitted (or preempted); RUNNING: holds blocks."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One token stream: prompt plus generated tokens, and where its K/V lives.

    Invariants:
        * ``token_ids[:num_prompt_tokens]`` is the prompt; the rest are generated tokens.
        * ``num_computed_tokens <= len(token_ids)``; the K/V of the first
          ``num_computed_tokens`` tokens is in the cache, in the blocks of ``block_table``.
        * ``block_hashes[i]`` is the prefix-cache hash of full block ``i`` (only for blocks whose
          tokens are all computed); ``len(block_hashes) <= len(block_table)``.
        * ``token_block_hashes`` is the hash chain of the leading full blocks of ``token_ids``,
          whether computed or not, filled on demand by the block manager. Tokens are only ever
          appended, so a full block's hash never changes.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_table",
        "block_hashes", "token_block_hashes", "status", "cumulative_logprob", "output_logprobs",
        "finish_reason", "stop_reason", "generator", "detokenizer", "text", "index", "score",
        "processor_states", "lora_int_id",
    )

    def __init__(self, token_ids: list[int], index: int = 0) -> None:
        self.seq_id: int = next(_seq_ids)
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens: int = len(token_ids)
        self.num_computed_tokens: int = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.token_block_hashes: list[int] = []
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.cumulative_logprob: float = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: Any = None  # a torch.Generator, owned by the engine
        self.detokenizer: Any = None
        self.text: str = ""
        self.index: int = index
        self.score: float | None = None  # beam score, set on finished beam hypotheses
        # One state per stateful logits processor of the request (SequenceGroup.processors),
        # or None when they are to be built (again) from the tokens, e.g. after a preemption.
        self.processor_states: list[Any] | None = None
        self.lora_int_id: int = 0  # the request's LoRA adapter (0: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_fresh(self) -> bool:
        """Nothing of it is cached yet: the only state in which prefix-cache hits apply."""
        return not self.block_table and self.num_computed_tokens == 0

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def fork(self, index: int) -> "Sequence":
        """A new sequence with a copy of this one's tokens and state, and an empty block table.

        The caller shares the blocks through ``BlockManager.fork``.
        """
        child = Sequence(self.token_ids, index=index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.token_block_hashes = list(self.token_block_hashes)
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.text = self.text
        child.lora_int_id = self.lora_int_id
        if self.processor_states is not None:
            child.processor_states = [state.fork() for state in self.processor_states]
        return child

    def reset_for_recompute(self) -> None:
        """Forget every cached token (the blocks were freed): all tokens will be recomputed.

        The processor states go too; the engine rebuilds them from the tokens when the
        sequence samples again."""
        self.processor_states = None
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")


@dataclass
class RequestStats:
    """Per-request accounting, exposed on ``RequestOutput.stats``.

    ``num_logical_blocks`` is what the request's sequences would hold without any sharing
    (each sequence's own table length); ``num_physical_blocks`` is the distinct blocks they
    actually hold. Both are taken at their peak over the request's life.
    """

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_physical_blocks: int = 0
    num_logical_blocks: int = 0
    num_cow_copies: int = 0
    num_preemptions: int = 0


@dataclass
class SequenceGroup:
    """All sequences of one request.

    ``seqs`` holds the live and finished sequences; ``finished_seqs`` collects sequences that
    left the group early (beams that ended, samples that hit a stop). ``params`` is a
    SamplingParams or BeamSearchParams. ``arrival`` orders groups (older = smaller).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any
    arrival: int
    seqs: list[Sequence] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    beam_state: Any = None
    # The request's stateful logits processors (plugins' and structured outputs'); each live
    # sequence holds one state per processor, in this order.
    processors: list[Any] = field(default_factory=list)
    forked: bool = False  # True once the prompt's sequence has been forked into n / beams
    # After preemption, a forked group recomputes its prompt once, on its first live sequence,
    # and then shares those blocks with the others (instead of one prompt copy per sequence).
    recompute_prompt_first: bool = False
    # Where the scheduler keeps the group in its waiting queue (smallest first); see
    # Scheduler.add.
    queue_key: tuple[int, ...] = ()
    # Prompt logprobs computed so far, one entry per prompt token (None until scored); see
    # batchgen.engine.prompt_logprobs.
    prompt_logprobs: list[Any] | None = None
    # The request's LoRA adapter (a batchgen.lora.LoRARequest's lora_int_id; 0: the base model).
    lora_int_id: int = 0

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.error is not None or not self.live_seqs()
