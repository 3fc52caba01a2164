"""Scheduler: which sequences run this step, and how many tokens each (pure Python).

Policy
------
* Continuous batching: groups join between steps and leave as soon as they finish.
* One token budget per step (``max_num_batched_tokens``) shared by decodes and prefill
  chunks, and at most ``max_num_seqs`` running sequences.
* Running groups first, oldest first; then waiting groups, first come first served (no
  skipping, so a large request is never starved by smaller ones behind it).
* Long prompts are prefilled in chunks (chunked prefill). A group with several sequences
  (samples or beams) steps all of them together, so that beams always see the same step.
* Admission needs free blocks beyond a small watermark.
* When blocks run out, the newest running group is preempted by recompute: all its blocks are
  freed and it goes back to the head of the waiting queue, to be prefilled again later. The
  oldest group therefore always progresses: no deadlock, and never an out-of-memory crash.
* A request that can never fit gets a per-request error; the rest goes on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``scheduled`` lists (sequence, number of new tokens), decodes (1 token) first; ``copies``
    are the copy-on-write block copies to run before the forward; ``errored`` are groups that
    failed for good this step (their ``error`` is set).
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    errored: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one BlockManager.

    Args:
        block_manager: the block allocator.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence (prompt + output) the model takes.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, group: SequenceGroup) -> str | None:
        """Queue a group; returns an error message (and queues nothing) if it can never run."""
        num_tokens = len(group.prompt_token_ids)
        if num_tokens == 0:
            return "the prompt is empty"
        if num_tokens >= self.max_model_len:
            return (f"the prompt has {num_tokens} tokens; the model takes at most "
                    f"{self.max_model_len} (prompt plus at least one generated token)")
        usable = self.bm.num_blocks - self.bm.watermark_blocks
        need = self.bm.num_blocks_for(num_tokens + 1)
        if need > usable:
            return (f"the prompt has {num_tokens} tokens and needs {need} KV blocks of "
                    f"{self.bm.block_size} tokens, but the cache has only {usable} usable; "
                    "raise kv_cache_memory or shorten the prompt")
        self.waiting.append(group)
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.live_seqs()) for g in self.running)

    def free_seq(self, seq: Sequence) -> None:
        """Release a finished sequence's blocks at once."""
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq)

    def finish_group(self, group: SequenceGroup) -> None:
        """Drop a finished (or failed) group and free whatever it still holds."""
        for seq in group.seqs:
            if seq.block_table:
                self.bm.free(seq)
        if group in self.running:
            self.running.remove(group)

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Plan one step. Mutates block tables (allocation, copy-on-write, preemption)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []

        i = 0
        while i < len(self.running):
            group = self.running[i]
            plan = self._plan(group, budget)
            if plan is None:  # no budget for it this step
                i += 1
                continue
            copies = self._allocate(group, plan, admit=False)
            while copies is None:
                victim = self.running[-1]
                if victim is group and len(self.running) == 1:
                    group.error = ("the request needs more KV cache than the whole cache holds "
                                   f"({self.bm.num_blocks} blocks of {self.bm.block_size} tokens); "
                                   "raise kv_cache_memory, or lower n / beam_width / max_tokens")
                    self.finish_group(group)
                    out.errored.append(group)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is group:
                    break
                copies = self._allocate(group, plan, admit=False)
            if copies is None:
                continue  # the group left the running list; do not advance i
            out.copies.extend(copies)
            for seq, n in plan:
                (decodes if n == 1 else prefills).append((seq, n))
                budget -= n
            i += 1

        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self.num_running_seqs + _max_seqs(group) > self.max_num_seqs and self.running:
                break
            plan = self._plan(group, budget, admitting=True)
            if plan is None:
                break
            copies = self._allocate(group, plan, admit=True)
            if copies is None:
                break
            self.waiting.popleft()
            for seq in group.seqs:
                if not seq.is_finished:
                    seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            out.copies.extend(copies)
            for seq, n in plan:
                (decodes if n == 1 else prefills).append((seq, n))
                budget -= n

        out.scheduled = decodes + prefills
        return out

    def _plan(self, group: SequenceGroup, budget: int, admitting: bool = False) -> list[tuple[Sequence, int]] | None:
        """How many tokens each live sequence of ``group`` computes this step, or None.

        A single sequence takes what the budget allows (chunked prefill). Several sequences
        step together: all of them to their end when that fits the budget; when their total
        can never fit one step, each is chunked but stops one token short of its end, so that
        they all reach their last token (and sample) in the same step.
        """
        seqs = group.live_seqs()
        if admitting and self.bm.enable_prefix_caching:
            remaining = []
            for seq in seqs:
                hit_blocks, hit_tokens = self.bm.get_computed_blocks(seq)
                remaining.append(seq.num_tokens - hit_tokens)
        else:
            remaining = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]
        total = sum(remaining)
        if total == 0 or budget <= 0:
            return None
        if len(seqs) == 1:
            return [(seqs[0], min(remaining[0], budget))]
        if total <= budget:
            return list(zip(seqs, remaining))
        if total <= self.max_num_batched_tokens:
            return None  # fits a later step whole; wait for the budget
        plan: list[tuple[Sequence, int]] = []
        for seq, rem in zip(seqs, remaining):
            n = min(rem - 1, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan or None

    def _allocate(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], admit: bool) -> list[tuple[int, int]] | None:
        """Allocate slots for every planned sequence, all or nothing.

        The blocks needed are counted first (an over-estimate when sequences share a block
        that only some of them will copy), so either every allocation succeeds or none is made.
        """
        lookups: list[list[int]] = []
        needed = 0
        for seq, n in plan:
            fresh = not seq.block_table and seq.num_computed_tokens == 0
            hits = self.bm.get_computed_blocks(seq)[0] if fresh else []
            lookups.append(hits)
            needed += self.bm.num_blocks_needed(seq, n, hits)
        if not self.bm.can_allocate(needed, admit=admit):
            return None
        copies: list[tuple[int, int]] = []
        for (seq, n), hits in zip(plan, lookups):
            fresh = not seq.block_table and seq.num_computed_tokens == 0
            result = self.bm.allocate_slots(seq, n, hits, admit=False)
            assert result is not None, "allocation failed after the block count said it fits"
            if fresh:
                self.bm.record_prefix_lookup(seq.num_tokens, seq.num_computed_tokens)
                if seq.num_output_tokens == 0:
                    group.stats.num_cached_tokens += seq.num_computed_tokens
            copies.extend(result)
        return copies

    def _preempt(self, group: SequenceGroup) -> None:
        """Preempt by recompute: free every block; the group waits at the head of the queue."""
        for seq in group.seqs:
            if seq.block_table:
                self.bm.free(seq)
            if not seq.is_finished:
                seq.reset_for_recompute()
        self.running.remove(group)
        self.waiting.appendleft(group)
        group.stats.num_preemptions += 1
        self.num_preemptions += 1


def _max_seqs(group: SequenceGroup) -> int:
    """Sequences the group will hold once forked (n, best_of or beam_width)."""
    params = group.params
    width = getattr(params, "beam_width", None)
    if width is not None:
        return int(width)
    return int(getattr(params, "best_of", None) or getattr(params, "n", 1))
