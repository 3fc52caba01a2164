"""Scheduler: which sequences run this step, and how many tokens each (pure Python).

Policy
------
* Continuous batching: groups join between steps and leave as soon as they finish.
* One token budget per step (``max_num_batched_tokens``) shared by decodes and prefill
  chunks, and at most ``max_num_seqs`` running sequences.
* Running groups first, in admission order; then waiting groups in queue order (no skipping,
  so a large request is never starved by smaller ones behind it).
* The waiting queue's order (``scheduling_policy``): ``"fcfs"`` is arrival order;
  ``"prefix"`` (the default) keeps requests that share leading prompt blocks next to each
  other, so that a prefix is computed once and reused while it is still cached. A request
  moves ahead only of requests that arrived at most ``lookahead`` arrivals before it, so no
  request waits behind more than that many later ones. Preempted groups go first either way.
* Prefix-aware admission: a waiting request whose leading full blocks are cached, or are
  being computed in this very step by a sequence scheduled before it (pending blocks, see
  ``block_manager``), starts after them; so requests sharing a prefix that arrive together
  compute it once, in the first one's step. A request never waits for a prefix: a sequence
  whose prefill is chunked over several steps uses up each step's budget, so nothing is
  admitted behind it until its last chunk, which is pending in the step that computes it.
* Long prompts are prefilled in chunks (chunked prefill). A group with several sequences
  (samples or beams) steps all of them together, so that beams always see the same step.
* Admission needs free blocks beyond a small watermark, and stops for the step in which a
  preemption happened (admitting then would only preempt again).
* When blocks run out, the most recently admitted group is preempted by recompute: all its
  blocks are freed and it goes back to the head of the waiting queue, to be prefilled again
  later. The first admitted group therefore always progresses: no deadlock, and never an
  out-of-memory crash.
* A request that can never fit gets a per-request error; the rest goes on.
* With a sliding window on every layer, each running sequence releases the blocks behind its
  next token's window before it is planned (``BlockManager.release_behind_window``), so a long
  sequence holds about a window of blocks, and a prompt fits when a window and a step's chunk do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine import prompt_logprobs, prompts
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.config import SCHEDULING_POLICIES
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus


PlanEntry = tuple[Sequence, int, list[int]]
"""(sequence, tokens to compute this step, its prefix-cache hits if it is fresh)."""



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
        scheduling_policy: the waiting queue's order, ``"prefix"`` or ``"fcfs"`` (see the
            module docstring).

    ``lookahead`` is how many waiting requests the engine keeps queued (and so how far the
    ``"prefix"`` order may move a request ahead).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        scheduling_policy: str = "prefix",
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {scheduling_policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.scheduling_policy = scheduling_policy
        self.lookahead = max(max_num_seqs, 8)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.max_loras = 0  # LoRA: most adapters running at once (0: no LoRA); set by the engine
        # "prefix" order: the arrival at which each prompt-block hash (a node of the prefix
        # tree) was first seen, within the last ``lookahead`` arrivals.
        self._anchors: dict[int, int] = {}
        self._anchors_pruned_at = 0

    # ------------------------------------------------------------------ queue
    def add(self, group: SequenceGroup) -> str | None:
        """Queue a group; returns an error message (and queues nothing) if it can never run."""
        num_tokens = len(group.prompt_token_ids)
        error = prompts.length_error(num_tokens, group.params, self.max_model_len)
        if error is not None:
            return error
        if _max_seqs(group) > self.max_num_seqs:
            return (f"the request runs {_max_seqs(group)} sequences (n, best_of or beam_width) "
                    f"but max_num_seqs is {self.max_num_seqs}; raise max_num_seqs")
        usable = self.bm.num_usable_blocks - self.bm.watermark_blocks
        need = self.bm.most_blocks_held(num_tokens + 1, self.max_num_batched_tokens)
        if need > usable:
            return (f"the prompt has {num_tokens} tokens and needs {need} KV blocks of "
                    f"{self.bm.block_size} tokens, but the cache has only {usable} usable; "
                    "raise kv_cache_memory or shorten the prompt")
        group.queue_key = self._queue_key(group)
        self._enqueue(group)
        return None

    def _queue_key(self, group: SequenceGroup) -> tuple[int, ...]:
        """The group's place in the waiting queue (smallest first).

        ``"fcfs"``: ``(1, arrival)``. ``"prefix"``: ``(1, a_0, .., a_k, arrival)``, where
        ``a_i`` is the arrival that first brought the prompt's leading ``i + 1`` full blocks
        (their chain hash). Sorting by it walks the tree of shared prefixes depth first, so
        requests with a common prefix are adjacent. An ``a_i`` older than ``lookahead``
        arrivals is renewed to this arrival, which bounds how many later arrivals can pass a
        request.
        """
        arrival = group.arrival
        if self.scheduling_policy != "prefix" or not self.bm.enable_prefix_caching or not group.seqs:
            return (1, arrival)
        lead = group.seqs[0]
        num_blocks = self.bm.max_hit_blocks(lead)
        horizon = arrival - self.lookahead
        key = [1]
        for h in self.bm.block_hashes_of(lead, num_blocks)[:num_blocks]:
            first = self._anchors.get(h)
            if first is None or first < horizon:
                first = self._anchors[h] = arrival
            key.append(first)
        key.append(arrival)
        if arrival - self._anchors_pruned_at >= self.lookahead:
            self._anchors = {h: a for h, a in self._anchors.items() if a >= horizon}
            self._anchors_pruned_at = arrival
        return tuple(key)

    def _enqueue(self, group: SequenceGroup) -> None:
        """Insert ``group`` into the waiting queue, which stays sorted by ``queue_key``."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].queue_key > group.queue_key:
            i -= 1
        self.waiting.insert(i, group)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        """Running sequences, counting a group that has not forked yet at its final size."""
        return sum(len(g.live_seqs()) if g.forked else _max_seqs(g) for g in self.running)

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
        self.bm.begin_step()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running):
            group = self.running[i]
            self._share_recomputed_prompt(group)
            for seq in group.live_seqs():
                self.bm.release_behind_window(seq)
            plan = self._plan(group, budget)
            if plan is None:  # no budget for it this step
                i += 1
                continue
            copies = self._allocate(group, plan, admit=False)
            while copies is None:
                victim = self.running[-1]
                if victim is group and len(self.running) == 1:
                    group.error = ("the request needs more KV cache than the whole cache holds "
                                   f"({self.bm.num_usable_blocks} blocks of {self.bm.block_size} tokens); "
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
            budget -= _take(plan, decodes, prefills)
            i += 1

        # After a preemption, admit nothing this step: the blocks just freed are what the
        # running groups need to grow, and admitting now would only preempt again (thrashing).
        if self.waiting and budget > 0 and not out.preempted:
            self._admit(out, budget, decodes, prefills)

        out.scheduled = decodes + prefills
        return out

    def _admit(self, out: SchedulerOutput, budget: int, decodes: list[tuple[Sequence, int]],
               prefills: list[tuple[Sequence, int]]) -> None:
        """Admit waiting groups in queue order while the budget, the sequence limit and the
        free blocks allow, adding them to ``decodes`` / ``prefills``. Each one's prefix lookup
        sees the blocks that the groups planned before it complete in this step."""
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self.running and self.num_running_seqs + _max_seqs(group) > self.max_num_seqs:
                break
            if self.max_loras and not _lora_fits(self.running, group.lora_int_id, self.max_loras):
                break  # its adapter waits for a slot (at most max_loras adapters run at once)
            plan = self._plan(group, budget)
            if plan is None:
                break
            copies = self._allocate(group, plan, admit=True)
            if copies is None:
                break
            self.waiting.popleft()
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            out.copies.extend(copies)
            budget -= _take(plan, decodes, prefills)

    def _share_recomputed_prompt(self, group: SequenceGroup) -> None:
        """Once a preempted group's first sequence has recomputed the prompt, share those
        blocks with the group's other sequences (they only recompute their own tokens)."""
        if not group.recompute_prompt_first:
            return
        seqs = group.live_seqs()
        lead = seqs[0]
        num_prompt = lead.num_prompt_tokens
        if lead.num_computed_tokens < num_prompt:
            return
        assert lead.num_computed_tokens == num_prompt
        for seq in seqs[1:]:
            if seq.is_fresh:
                self.bm.fork(lead, seq, num_tokens=num_prompt)
                seq.num_computed_tokens = num_prompt
                seq.block_hashes = lead.block_hashes[: num_prompt // self.bm.block_size]
                seq.status = SequenceStatus.RUNNING
        group.recompute_prompt_first = False

    def _lookup(self, group: SequenceGroup, seq: Sequence, max_num_tokens: int | None = None) -> tuple[list[int], int]:
        """(prefix hits, first token to compute) of a sequence; hits only for a fresh one, and
        never over a position whose logits score a prompt token (prompt logprobs)."""
        if seq.is_fresh:
            limit = prompt_logprobs.max_cached_tokens(group.params)
            if limit is not None:
                max_num_tokens = limit if max_num_tokens is None else min(max_num_tokens, limit)
            return self.bm.get_computed_blocks(seq, max_num_tokens)
        return [], seq.num_computed_tokens

    def _plan(self, group: SequenceGroup, budget: int) -> list[PlanEntry] | None:
        """How many tokens each live sequence of ``group`` computes this step, or None.

        A single sequence takes what the budget allows (chunked prefill). Several sequences
        step together: all of them to their end when that fits the budget; when their total
        can never fit one step, each is chunked but stops one token short of its end, so that
        they all reach their last token (and sample) in the same step. A preempted forked
        group first recomputes the prompt on its first sequence alone.
        """
        if budget <= 0:
            return None
        seqs = group.live_seqs()
        if group.recompute_prompt_first:
            lead = seqs[0]
            hits, start = self._lookup(group, lead, max_num_tokens=lead.num_prompt_tokens - 1)
            n = min(lead.num_prompt_tokens - start, budget)
            return [(lead, n, hits)] if n > 0 else None
        lookups = [self._lookup(group, seq) for seq in seqs]
        remaining = [seq.num_tokens - start for seq, (_, start) in zip(seqs, lookups)]
        total = sum(remaining)
        if total == 0:
            return None
        if len(seqs) == 1:
            return [(seqs[0], min(remaining[0], budget), lookups[0][0])]
        if total <= budget:
            return [(seq, rem, hits) for seq, rem, (hits, _) in zip(seqs, remaining, lookups)]
        if total <= self.max_num_batched_tokens:
            return None  # fits a later step whole; wait for the budget
        plan: list[PlanEntry] = []
        for seq, rem, (hits, _) in zip(seqs, remaining, lookups):
            n = min(rem - 1, budget)
            if n > 0:
                plan.append((seq, n, hits))
                budget -= n
        return plan or None

    def _allocate(self, group: SequenceGroup, plan: list[PlanEntry], admit: bool) -> list[tuple[int, int]] | None:
        """Allocate slots for every planned sequence, all or nothing.

        The exact block count comes first; then every prefix hit is pinned before any new
        block is taken, so that this step's own allocations cannot evict them.
        """
        if not self.bm.can_allocate(self.bm.num_blocks_needed_for_group(plan), admit=admit):
            return None
        for seq, _, hits in plan:
            if seq.is_fresh:
                self.bm.take_computed_blocks(seq, hits)
                self.bm.record_prefix_lookup(seq.num_tokens, seq.num_computed_tokens)
                if seq.num_output_tokens == 0:
                    group.stats.num_cached_tokens += seq.num_computed_tokens
        copies: list[tuple[int, int]] = []
        for seq, n, _ in plan:
            result = self.bm.allocate_slots(seq, n)
            assert result is not None, "allocation failed after the block count said it fits"
            copies.extend(result)
        return copies

    def _preempt(self, group: SequenceGroup) -> None:
        """Preempt by recompute: free every block; the group waits at the head of the queue."""
        for seq in group.seqs:
            if seq.block_table:
                self.bm.free(seq)
            if not seq.is_finished:
                seq.reset_for_recompute()
        group.recompute_prompt_first = len(group.live_seqs()) > 1
        self.running.remove(group)
        group.queue_key = (0, group.arrival)  # preempted groups go first, oldest first
        self._enqueue(group)
        group.stats.num_preemptions += 1
        self.num_preemptions += 1


def _take(plan: list[PlanEntry], decodes: list[tuple[Sequence, int]],
          prefills: list[tuple[Sequence, int]]) -> int:
    """Add a planned group's sequences to the step (one-token entries are decodes); returns
    the tokens they use."""
    for seq, n, _ in plan:
        (decodes if n == 1 else prefills).append((seq, n))
    return sum(n for _, n, _ in plan)


def _lora_fits(running: list[SequenceGroup], lora_int_id: int, max_loras: int) -> bool:
    """Whether a group of adapter ``lora_int_id`` may join ``running`` without more than
    ``max_loras`` adapters running at once (the base model, id 0, always may)."""
    if not lora_int_id:
        return True
    ids = {g.lora_int_id for g in running if g.lora_int_id}
    return lora_int_id in ids or len(ids) < max_loras


def _max_seqs(group: SequenceGroup) -> int:
    """Sequences the group will hold once forked (n, best_of or beam_width)."""
    params = group.params
    width = getattr(params, "beam_width", None)
    if width is not None:
        return int(width)
    return int(getattr(params, "best_of", None) or getattr(params, "n", 1))
