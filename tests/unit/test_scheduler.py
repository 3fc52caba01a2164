"""Scheduler tests with a real BlockManager, real sequence groups and no model.

``FakeEngine`` plays the engine's step loop around ``Scheduler.schedule()``: it applies the
step's copy-on-write copies and writes every scheduled token into a model of the KV cache
(block id -> token per slot), advances ``num_computed_tokens``, registers full blocks in the
prefix cache, "samples" a deterministic token for every sequence that reached its end, forks
n-sampling groups after their prompt and runs beam steps (fork survivors, free dead beams),
and finishes sequences and groups after ``max_tokens``. After every step it checks the
scheduler's contracts (token budget, ``max_num_seqs``, decodes first, FCFS order, whole-group
preemption) and the block manager's invariants, and reads every sequence's computed tokens
back through its block table. With a sliding ``window``, once a step's K/V is written (a step
writes all of it before attention reads any: a prefix hit may be a block that a sequence
scheduled before it fills in the same step) it reads back, for every scheduled chunk, the
positions its first token attends to (the window behind it), and after the step those of every
sequence's next token; the released entries name the null block, which is never written.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest

from batchgen.engine.block_manager import NULL_BLOCK, BlockManager
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.sampling.params import BeamSearchParams, SamplingParams

Params = SamplingParams | BeamSearchParams


def _token(request_id: str, seq: Sequence) -> int:
    """The deterministic 'sampled' token of a sequence at its current length (vocab of 3)."""
    return zlib.crc32(f"{request_id}/{seq.index}/{seq.num_tokens}".encode()) % 3


@dataclass
class StepLog:
    """What one step did, for the tests' own assertions."""

    scheduled: list[tuple[str, int, int]] = field(default_factory=list)  # (request, seq index, n)
    preempted: list[str] = field(default_factory=list)
    preempted_sizes: list[int] = field(default_factory=list)  # live sequences of each victim
    errored: list[str] = field(default_factory=list)
    running_seqs: int = 0


class FakeEngine:
    """The engine's step loop without a model; see the module docstring."""

    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 4096,
                 watermark: float = 0.0, enable_prefix_caching: bool = True,
                 check_max_num_seqs: bool = True, scheduling_policy: str = "prefix",
                 window: int | None = None) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching, watermark, window=window)
        self.window = window
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_model_len,
                               scheduling_policy)
        self.kv: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.groups: dict[str, SequenceGroup] = {}
        self.arrivals = 0
        self.admitted: list[str] = []  # request ids in first-admission order
        self.finished: list[str] = []  # request ids in finish order
        self.errors: dict[str, str] = {}
        self.log: list[StepLog] = []
        self.beam_rng: dict[str, random.Random] = {}
        self.check_max_num_seqs = check_max_num_seqs
        self.prefill_tokens = 0

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt: list[int], params: Params) -> str | None:
        self.arrivals += 1
        group = SequenceGroup(request_id, None, list(prompt), params, self.arrivals)
        group.seqs.append(Sequence(prompt))
        error = self.sched.add(group)
        if error is None:
            self.groups[request_id] = group
            self.beam_rng[request_id] = random.Random(zlib.crc32(request_id.encode()))
        return error

    # ------------------------------------------------------------------ the loop
    def run(self, max_steps: int = 10_000) -> None:
        """Step until every request finished; fails on a stuck scheduler or too many steps."""
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: "
                             f"{len(self.sched.running)} running, {len(self.sched.waiting)} waiting")

    def step(self) -> SchedulerOutput:
        sched, bm = self.sched, self.bm
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = sched.schedule()
        log = StepLog(scheduled=[(self._group_of(s).request_id, s.index, n) for s, n in out.scheduled],
                      preempted=[g.request_id for g in out.preempted],
                      preempted_sizes=[len(g.live_seqs()) for g in out.preempted],
                      errored=[g.request_id for g in out.errored])
        self.log.append(log)
        # Prefill work: every scheduled token but the one-token decodes of generated tokens.
        self.prefill_tokens += sum(n for seq, n in out.scheduled
                                   if n > 1 or seq.num_output_tokens == 0
                                   or seq.num_computed_tokens + 1 < seq.num_tokens)
        assert not (out.is_empty and sched.waiting and not sched.running), (
            "stuck: nothing scheduled, nothing running, and the head of the queue not admitted")

        # The step's budget and the decodes-first order.
        assert out.num_tokens <= sched.max_num_batched_tokens
        for seq, n in out.scheduled:
            assert 1 <= n and seq.num_computed_tokens + n <= seq.num_tokens, (
                f"{n} tokens scheduled for {seq}: past its last token")
        sizes = [n for _, n in out.scheduled]
        first_prefill = next((i for i, n in enumerate(sizes) if n > 1), len(sizes))
        assert all(n > 1 for n in sizes[first_prefill:]), f"a decode after a prefill: {sizes}"
        assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
        self._check_preemptions(running_before, out)
        self._check_admission_order(waiting_before, out)
        for group in sched.running:
            if group.request_id not in self.admitted:
                self.admitted.append(group.request_id)
        for group in out.errored:
            assert group.error is not None
            self.errors[group.request_id] = group.error
            self.finished.append(group.request_id)
            assert all(not s.block_table for s in group.seqs)

        # The model runner: batched copies first, then every scheduled token's K/V.
        for src, dst in out.copies:
            self.kv[dst] = list(self.kv[src])
        for seq, n in out.scheduled:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[pos // bm.block_size]
                assert not (self.window and block == NULL_BLOCK), f"{seq}: position {pos} written to the null block"
                self.kv[block][pos % bm.block_size] = seq.token_ids[pos]
        if self.window:  # the step's K/V all written, what each chunk's first token attends to is there
            for seq, _ in out.scheduled:
                self._check_read(seq, max(0, seq.num_computed_tokens - self.window + 1), seq.num_computed_tokens)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
        self._check_kv()

        # Sampling: every sequence whose tokens are all computed gets a new token.
        ended: dict[str, list[Sequence]] = {}
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                ended.setdefault(self._group_of(seq).request_id, []).append(seq)
        for request_id, seqs in ended.items():
            group = self.groups[request_id]
            if isinstance(group.params, BeamSearchParams):
                assert {id(s) for s in seqs} == {id(s) for s in group.live_seqs()}, (
                    "beams of one group must all reach their last token in the same step")
                self._beam_step(group, seqs)
            else:
                self._sample(group, seqs)
        for group in list(sched.running):
            if group.is_finished:
                sched.finish_group(group)
                self.finished.append(group.request_id)

        live = [s for g in sched.running for s in g.live_seqs()]
        log.running_seqs = len(live)
        assert not self.check_max_num_seqs or sched.num_running_seqs <= sched.max_num_seqs, (
            f"{sched.num_running_seqs} sequences running, max_num_seqs is {sched.max_num_seqs}")
        holders = [s for g in list(sched.running) + list(sched.waiting) for s in g.seqs if s.block_table]
        bm.check_invariants(holders)
        for group in sched.waiting:
            assert all(not s.block_table for s in group.seqs), (
                f"waiting group {group.request_id} still holds blocks")
            assert all(s.num_computed_tokens == 0 for s in group.live_seqs())
        self._check_kv()
        return out

    # ------------------------------------------------------------------ sampling
    def _sample(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """n-sampling: fork after the prompt, then each sample appends its own token; sample
        ``i`` stops after ``max_tokens - i`` tokens so that samples leave at different times."""
        params: SamplingParams = group.params
        if not group.forked:
            group.forked = True
            (parent,) = seqs
            for i in range(1, params.num_sequences):
                child = parent.fork(index=i)
                self.bm.fork(parent, child)
                group.seqs.append(child)
                seqs = seqs + [child]
        for seq in seqs:
            seq.append_token(_token(group.request_id, seq), 0.0)
            if seq.num_output_tokens >= max(1, params.max_tokens - seq.index):
                self.sched.free_seq(seq)

    def _beam_step(self, group: SequenceGroup, beams: list[Sequence]) -> None:
        """As the engine's beam step: ``beam_width`` new beams pick parents (some twice, some
        never); a parent with several children is forked first; dead beams are freed."""
        params: BeamSearchParams = group.params
        beams = sorted(beams, key=lambda s: s.index)
        rng = self.beam_rng[group.request_id]
        parents = sorted(rng.randrange(len(beams)) for _ in range(params.beam_width))
        remaining = {p: parents.count(p) for p in parents}
        new: list[Sequence] = []
        for p in parents:
            parent = beams[p]
            remaining[p] -= 1
            if remaining[p] > 0:
                seq = parent.fork(index=len(new))
                self.bm.fork(parent, seq)
            else:
                seq = parent
                seq.index = len(new)
            seq.append_token(_token(group.request_id, seq), 0.0)
            new.append(seq)
        alive = {id(s) for s in new}
        for beam in beams:
            if id(beam) not in alive:
                self.sched.free_seq(beam)
        group.forked = True
        group.seqs = new
        if new[0].num_output_tokens >= params.max_tokens:
            for seq in new:
                self.sched.free_seq(seq)

    # ------------------------------------------------------------------ checks
    def _group_of(self, seq: Sequence) -> SequenceGroup:
        for group in self.groups.values():
            if any(s is seq for s in group.seqs):
                return group
        raise AssertionError(f"{seq} belongs to no group")

    def _check_kv(self) -> None:
        """Every sequence holding blocks reads its computed tokens back from the KV model (with
        a window, those its next token attends to)."""
        for group in self.sched.running:
            for seq in group.seqs:
                if seq.block_table:
                    end = seq.num_computed_tokens
                    self._check_read(seq, max(0, end - self.window + 1) if self.window else 0, end)

    def _check_read(self, seq: Sequence, start: int, end: int) -> None:
        """``seq``'s positions ``start .. end`` read back through its block table."""
        bs = self.bm.block_size
        blocks = [seq.block_table[p // bs] for p in range(start, end)]
        assert not (self.window and NULL_BLOCK in blocks), f"{seq}: positions {start}..{end} released"
        read = [self.kv[b][p % bs] for b, p in zip(blocks, range(start, end))]
        assert read == seq.token_ids[start:end], (
            f"request {self._group_of(seq).request_id} sample {seq.index} reads {read} at {start}..{end}, "
            f"expected {seq.token_ids[start:end]}")

    def _check_preemptions(self, running_before: list[SequenceGroup], out: SchedulerOutput) -> None:
        """Preemption takes the most recently admitted running group each time, and all of
        its sequences."""
        candidates = [g for g in running_before if g not in out.errored]
        for victim in out.preempted:
            assert victim is candidates[-1], (
                f"preempted {victim.request_id} while groups admitted after it were running")
            candidates.remove(victim)
            if victim in self.sched.waiting:
                for seq in victim.seqs:
                    assert not seq.block_table
                for seq in victim.live_seqs():  # all to be recomputed
                    assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
        # The waiting queue stays in the policy's order: preempted groups first (oldest
        # first), then arrival order ("fcfs") or the prefix tree's order ("prefix").
        keys = [g.queue_key for g in self.sched.waiting]
        assert keys == sorted(keys), "the waiting queue lost its order"
        if self.sched.scheduling_policy == "fcfs":
            order = [(g.queue_key[0], g.arrival) for g in self.sched.waiting]
            assert order == sorted(order), "fcfs: the waiting queue is not in arrival order"

    def _check_admission_order(self, waiting_before: list[SequenceGroup], out: SchedulerOutput) -> None:
        """Admission takes the waiting queue in order, never skipping a group."""
        admitted = [g for g in waiting_before if g in self.sched.running]
        assert admitted == waiting_before[: len(admitted)], (
            f"admitted {[g.request_id for g in admitted]} out of the queue's order "
            f"{[g.request_id for g in waiting_before]}")

    def cache_prefix(self, tokens: list[int]) -> None:
        """Compute ``tokens`` in a throwaway sequence and free it: its full blocks stay in the
        prefix cache (and their contents in the KV model)."""
        bs = self.bm.block_size
        seq = Sequence(tokens)
        assert self.bm.allocate_slots(seq, len(tokens)) is not None
        for pos, token in enumerate(tokens):
            self.kv[seq.block_table[pos // bs]][pos % bs] = token
        seq.num_computed_tokens = len(tokens)
        self.bm.cache_full_blocks(seq)
        self.bm.free(seq)

    def assert_all_done(self) -> None:
        assert not self.sched.has_unfinished
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks, "blocks leaked"
        assert not self.window or self.kv[NULL_BLOCK] == [None] * self.bm.block_size, "the null block was written"
        self.bm.check_invariants([])
        assert sorted(self.finished) == sorted(self.groups)


def _prompt(length: int, salt: int) -> list[int]:
    return [(salt * 31 + i * 7) % 50 for i in range(length)]


# ---------------------------------------------------------------------- construction and add()
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
])
def test_scheduler_rejects_bad_limits(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Scheduler(BlockManager(8, 4), **kwargs)


def test_prompt_at_or_over_max_model_len_is_rejected() -> None:
    engine = FakeEngine(num_blocks=64, block_size=4, max_model_len=32)
    assert engine.add("long", _prompt(32, 0), SamplingParams(max_tokens=4)) == (
        "the prompt has 32 tokens; the model takes at most 32 (prompt plus at least one "
        "generated token)")
    assert engine.add("longer", _prompt(40, 0), SamplingParams(max_tokens=4)) == (
        "the prompt has 40 tokens; the model takes at most 32 (prompt plus at least one "
        "generated token)")
    assert engine.add("empty", [], SamplingParams(max_tokens=4)) == "the prompt is empty"
    assert engine.add("fits", _prompt(31, 0), SamplingParams(max_tokens=1)) is None
    assert [g.request_id for g in engine.sched.waiting] == ["fits"]
    engine.run()
    engine.assert_all_done()


def test_prompt_that_can_never_fit_gets_an_error_and_the_rest_goes_on() -> None:
    engine = FakeEngine(num_blocks=10, block_size=4, watermark=0.1)  # 9 usable blocks
    assert engine.add("a", _prompt(12, 1), SamplingParams(max_tokens=6)) is None
    error = engine.add("huge", _prompt(40, 2), SamplingParams(max_tokens=6))
    assert error == ("the prompt has 40 tokens and needs 11 KV blocks of 4 tokens, but the cache "
                     "has only 9 usable; raise kv_cache_memory or shorten the prompt")
    # 35 tokens plus one generated token need exactly the 9 usable blocks: accepted.
    assert engine.add("edge", _prompt(35, 3), SamplingParams(max_tokens=1)) is None
    assert engine.add("b", _prompt(5, 4), SamplingParams(max_tokens=6)) is None
    engine.run()
    engine.assert_all_done()
    assert sorted(engine.finished) == ["a", "b", "edge"] and not engine.errors


# ---------------------------------------------------------------------- budget and limits
def _mixed_workload(engine: FakeEngine, num_requests: int) -> None:
    for r in range(num_requests):
        if r % 5 == 3:
            params: Params = SamplingParams(n=3, max_tokens=5)
        elif r % 7 == 4:
            params = BeamSearchParams(beam_width=2, max_tokens=4)
        else:
            params = SamplingParams(max_tokens=3 + r % 6)
        assert engine.add(f"r{r}", _prompt(3 + (r * 13) % 40, r % 4), params) is None


def test_token_budget_and_max_num_seqs_hold_every_step() -> None:
    engine = FakeEngine(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=24)
    _mixed_workload(engine, 30)
    engine.run()
    engine.assert_all_done()
    assert max(len(step.scheduled) for step in engine.log) <= 8
    assert max(sum(n for _, _, n in step.scheduled) for step in engine.log) == 24  # budget used
    assert max(step.running_seqs for step in engine.log) <= 8


def test_max_num_seqs_counts_the_samples_a_group_will_fork_into() -> None:
    """Two n=3 requests: admitting the second next to the first (1 + 3 <= 4 sequences before
    the fork) runs 6 sequences once both prompts fork, over max_num_seqs = 4."""
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for r in range(2):
        assert engine.add(f"r{r}", _prompt(5, r), SamplingParams(n=3, max_tokens=6)) is None
    engine.run()
    engine.assert_all_done()


def test_chunked_prefill_of_a_long_prompt() -> None:
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert engine.add("long", _prompt(50, 0), SamplingParams(max_tokens=3)) is None
    engine.run()
    engine.assert_all_done()
    sizes = [step.scheduled for step in engine.log]
    # 50 prompt tokens in chunks of the budget, then one token per decode step.
    assert sizes == [[("long", 0, 16)], [("long", 0, 16)], [("long", 0, 16)], [("long", 0, 2)],
                     [("long", 0, 1)], [("long", 0, 1)]]
    assert engine.groups["long"].seqs[0].num_output_tokens == 3


def test_chunked_prefill_shares_the_budget_with_decodes_listed_first() -> None:
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    assert engine.add("short", _prompt(4, 0), SamplingParams(max_tokens=8)) is None
    engine.step()  # short's prefill
    assert engine.add("long", _prompt(30, 1), SamplingParams(max_tokens=2)) is None
    engine.step()
    # short decodes (1 token) first; long's prefill gets the rest of the budget.
    assert engine.log[-1].scheduled == [("short", 0, 1), ("long", 0, 9)]
    engine.step()
    assert engine.log[-1].scheduled == [("short", 0, 1), ("long", 0, 9)]
    engine.run()
    engine.assert_all_done()


def test_decodes_come_before_prefills_in_every_step() -> None:
    engine = FakeEngine(num_blocks=300, block_size=4, max_num_seqs=16, max_num_batched_tokens=32)
    _mixed_workload(engine, 20)
    engine.run()  # the order is asserted in every step
    engine.assert_all_done()
    mixed = [s.scheduled for s in engine.log
             if any(n == 1 for _, _, n in s.scheduled) and any(n > 1 for _, _, n in s.scheduled)]
    assert mixed, "no step mixed decodes and prefills: the test did not exercise the order"


def test_admission_is_first_come_first_served() -> None:
    """A big request at the head of the queue is not skipped by the small ones behind it."""
    engine = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    assert engine.add("first", _prompt(30, 0), SamplingParams(max_tokens=10)) is None  # 8+ blocks
    assert engine.add("big", _prompt(30, 1), SamplingParams(max_tokens=2)) is None
    for r in range(4):
        assert engine.add(f"small{r}", _prompt(3, r + 2), SamplingParams(max_tokens=2)) is None
    engine.step()
    # "big" does not fit next to "first"; the small ones, which would, wait behind it.
    assert [g.request_id for g in engine.sched.running] == ["first"]
    engine.run()
    engine.assert_all_done()
    assert engine.admitted == ["first", "big", "small0", "small1", "small2", "small3"]


def test_admission_keeps_the_watermark_free_but_running_groups_may_use_it() -> None:
    engine = FakeEngine(num_blocks=20, block_size=1, max_num_batched_tokens=64, watermark=0.25)
    assert engine.bm.watermark_blocks == 5
    assert engine.add("running", _prompt(13, 0), SamplingParams(max_tokens=5)) is None
    engine.step()  # 13 blocks used, 7 free
    assert engine.add("waiting", _prompt(3, 1), SamplingParams(max_tokens=1)) is None
    for _ in range(3):
        engine.step()
        # "waiting" needs 3 blocks: admitting it would leave fewer than 5 free.
        assert [g.request_id for g in engine.sched.running] == ["running"]
        assert engine.log[-1].scheduled == [("running", 0, 1)]
    assert engine.bm.num_free_blocks == 4  # the running request grew into the watermark
    engine.run()
    engine.assert_all_done()
    assert engine.admitted == ["running", "waiting"]


# ---------------------------------------------------------------------- preemption
def test_preemption_takes_the_newest_group_whole_and_everything_finishes() -> None:
    engine = FakeEngine(num_blocks=12, block_size=2, max_num_seqs=16, max_num_batched_tokens=64,
                        enable_prefix_caching=False)
    assert engine.add("old", _prompt(6, 0), SamplingParams(max_tokens=12)) is None
    assert engine.add("samples", _prompt(5, 1), SamplingParams(n=3, max_tokens=6)) is None
    assert engine.add("new", _prompt(4, 2), SamplingParams(max_tokens=10)) is None
    engine.run()
    engine.assert_all_done()
    preempted = [r for step in engine.log for r in step.preempted]
    assert preempted, "the cache was too big: nothing was preempted"
    assert engine.sched.num_preemptions == len(preempted)
    assert "old" not in preempted  # the oldest group always progresses
    # The forked group was preempted with all its samples together (each freed, checked
    # in every step).
    sizes = [n for step in engine.log for r, n in zip(step.preempted, step.preempted_sizes)
             if r == "samples"]
    assert sizes and max(sizes) == 3
    assert engine.groups["samples"].stats.num_preemptions >= 1
    assert not engine.errors
    # Every sample generated its tokens despite the recompute.
    samples = sorted(engine.groups["samples"].seqs, key=lambda s: s.index)
    assert [s.num_output_tokens for s in samples] == [6, 5, 4]


def test_preemption_of_beam_groups_under_a_tiny_cache() -> None:
    engine = FakeEngine(num_blocks=20, block_size=2, max_num_seqs=16, max_num_batched_tokens=32,
                        enable_prefix_caching=False)
    for r in range(4):
        assert engine.add(f"beam{r}", _prompt(5 + r, r), BeamSearchParams(beam_width=3, max_tokens=4)) is None
    engine.run()
    engine.assert_all_done()
    assert engine.sched.num_preemptions > 0
    assert not engine.errors
    for group in engine.groups.values():
        assert [s.num_output_tokens for s in group.seqs] == [4, 4, 4]


def _random_engine(seed: int, *, groups: bool, enable_prefix_caching: bool, windowed: bool = False) -> FakeEngine:
    """A random workload of 16 requests on a cache only a few prompts wide (``windowed``: with
    a random sliding window of 1 to 9 tokens)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    engine = FakeEngine(num_blocks=rng.randint(24, 40) // block_size + 6, block_size=block_size,
                        max_num_seqs=rng.choice([4, 8, 32]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                        watermark=0.05, enable_prefix_caching=enable_prefix_caching,
                        window=rng.randint(1, 9) if windowed else None)
    for r in range(16):
        kind = rng.random() if groups else 1.0
        if kind < 0.2:
            params: Params = SamplingParams(n=rng.randint(2, 3), max_tokens=rng.randint(1, 6))
        elif kind < 0.35:
            params = BeamSearchParams(beam_width=2, max_tokens=rng.randint(1, 5))
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 10))
        # Prompts from four families (a shared start), so that the prefix cache is hit; under a
        # window, up to twice the cache (their cached prefixes too)
        prompt = _prompt(rng.randint(1, 80 if windowed else 12), rng.randint(0, 3))
        engine.add(f"r{r}", prompt, params)  # one rejected up front is not in engine.groups
    return engine


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_no_deadlock_under_a_tiny_cache(enable_prefix_caching: bool) -> None:
    """Random single-sequence workloads: every request finishes, preemption happens, and every
    block is free at the end (each step also checks budget, FCFS order and the KV contents)."""
    preempted = hits = 0
    for seed in range(40):
        engine = _random_engine(seed, groups=False, enable_prefix_caching=enable_prefix_caching)
        engine.run()
        engine.assert_all_done()
        assert not engine.errors
        preempted += engine.sched.num_preemptions
        hits += engine.bm.prefix_cache_hits
    assert preempted > 0
    assert (hits > 0) == enable_prefix_caching


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_no_deadlock_under_a_tiny_cache_with_groups(enable_prefix_caching: bool) -> None:
    """Random workloads with n-sampling and beam groups: every request finishes (or fails only
    when alone it outgrows the whole cache), and every block is free at the end."""
    for seed in range(100):
        engine = _random_engine(seed, groups=True, enable_prefix_caching=enable_prefix_caching)
        engine.run()
        engine.assert_all_done()
        for error in engine.errors.values():
            assert error.startswith("the request needs more KV cache than the whole cache holds"), error


@pytest.mark.parametrize("groups", [False, True])
def test_windowed_workloads_release_what_no_token_reads_again(groups: bool) -> None:
    """Random workloads under a sliding window: every chunk still reads the window behind it
    (checked before each step's writes), everything finishes and every block is free at the
    end; blocks are released, and the null block is never written."""
    released = 0
    for seed in range(60):
        engine = _random_engine(seed, groups=groups, enable_prefix_caching=seed % 2 == 0, windowed=True)
        engine.run()
        engine.assert_all_done()
        for error in engine.errors.values():
            assert error.startswith("the request needs more KV cache than the whole cache holds"), error
        released += engine.bm.num_released_blocks
    assert released > 0


def test_a_windowed_sequence_outgrows_the_cache_without_preemption() -> None:
    """90 tokens need 23 blocks of 4 and the cache has 8: without a window the prompt alone
    cannot fit; with a window of 8 (7 blocks and the null block) the sequence holds a few."""
    prompt, params = _prompt(40, 1), SamplingParams(max_tokens=50)
    assert FakeEngine(num_blocks=8, block_size=4, max_num_batched_tokens=8).add("long", prompt, params) == (
        "the prompt has 40 tokens and needs 11 KV blocks of 4 tokens, but the cache has only 8 usable; "
        "raise kv_cache_memory or shorten the prompt")
    engine = FakeEngine(num_blocks=8, block_size=4, max_num_batched_tokens=8, window=8)
    assert engine.add("long", prompt, params) is None
    engine.run()
    engine.assert_all_done()
    assert not engine.errors and engine.sched.num_preemptions == 0
    assert engine.groups["long"].seqs[0].num_output_tokens == 50
    most = engine.bm.most_blocks_held(90, 8)
    assert engine.bm.peak_blocks_used <= most < 7
    assert engine.bm.num_released_blocks >= 23 - most


def test_a_cached_prefix_longer_than_the_cache_beside_a_chunk_is_taken_from_its_window() -> None:
    """A 40-token prompt leaves 10 full blocks of 4 in the prefix cache (of 11 usable); a
    second prompt that extends it hits them all and computes 8 more tokens: it takes only the
    hits its window reaches, so it runs (taking every hit, 10 + 2 blocks, it could never start)."""
    engine = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=16, window=8)
    prompt = _prompt(40, 3)
    assert engine.add("a", prompt, SamplingParams(max_tokens=1)) is None
    engine.run()
    assert len(engine.bm._evictable) == 10
    assert engine.add("b", prompt + [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=2)) is None
    engine.run(max_steps=50)
    engine.assert_all_done()
    assert not engine.errors and engine.bm.prefix_cache_hits == 40 and engine.bm.prefix_cache_hit_blocks == 10
    assert engine.groups["b"].seqs[0].num_output_tokens == 2


def test_group_that_outgrows_the_whole_cache_fails_alone() -> None:
    engine = FakeEngine(num_blocks=8, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert engine.add("greedy", _prompt(4, 0), SamplingParams(n=4, max_tokens=20)) is None
    assert engine.add("modest", _prompt(3, 1), SamplingParams(max_tokens=3)) is None
    engine.run()
    engine.assert_all_done()
    assert engine.errors == {"greedy": (
        "the request needs more KV cache than the whole cache holds (8 blocks of 2 tokens); "
        "raise kv_cache_memory, or lower n / beam_width / max_tokens")}
    assert engine.groups["greedy"].error == engine.errors["greedy"]
    assert engine.groups["modest"].seqs[0].num_output_tokens == 3


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hits_are_recorded_and_skip_computation() -> None:
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    system = _prompt(12, 9)
    assert engine.add("a", system + [1, 2], SamplingParams(max_tokens=2)) is None
    engine.step()
    assert engine.add("b", system + [3], SamplingParams(max_tokens=2)) is None
    engine.step()
    # b reuses a's three full blocks and computes only its last token.
    assert ("b", 0, 1) in engine.log[-1].scheduled
    assert engine.groups["b"].stats.num_cached_tokens == 12
    assert engine.bm.prefix_cache_hits == 12 and engine.bm.prefix_cache_queries == 14 + 13
    engine.run()
    engine.assert_all_done()


def test_readmitted_group_does_not_evict_its_own_prefix_hits() -> None:
    """A preempted two-sample group is re-admitted. Its lookups are taken for both samples
    first; allocating sample 0 must not evict a block that sample 1's lookup is about to reuse
    (else sample 0 writes its tokens into a block sample 1 reads as its own)."""
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)

    def computed(tokens: list[int]) -> Sequence:
        seq = Sequence(tokens)
        assert bm.allocate_slots(seq, len(tokens)) is not None
        seq.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(seq)
        return seq

    # Fill the cache with cached blocks; [1, 2] -> [7, 8] is sample 1's prefix, and its
    # tail block [7, 8] is the least recently used one.
    first = computed([1, 2, 7, 8])
    others = [computed([9] * 6), computed([3] * 6)]
    for seq in [first, *others]:
        bm.free(seq)
    assert bm.num_free_blocks == 8
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    group = SequenceGroup("r", None, [1, 2], SamplingParams(n=2, max_tokens=8), arrival=0)
    sample0, sample1 = Sequence([1, 2, 3, 4, 5], index=0), Sequence([1, 2, 7, 8, 6], index=1)
    for seq in (sample0, sample1):  # as after preemption: prompt plus own output, nothing computed
        seq.num_prompt_tokens = 2
    group.seqs, group.forked = [sample0, sample1], True
    assert sched.add(group) is None
    out = sched.schedule()
    assert len(out.scheduled) == 2
    bm.check_invariants([sample0, sample1])
    # Where sample 0 writes its next tokens, no other sequence may read computed tokens.
    written = {sample0.block_table[p // 2] for p in range(sample0.num_computed_tokens, 5)}
    read_by_1 = {sample1.block_table[p // 2] for p in range(sample1.num_computed_tokens)}
    assert not written & read_by_1, (
        f"sample 0 writes into {written & read_by_1}, which sample 1 reads as computed")


def test_sequence_left_out_of_a_readmission_chunk_is_not_scheduled_past_its_end() -> None:
    """A preempted two-sample group is re-admitted with a budget that chunks sample 0 only.
    Next step sample 1 (still fresh) is planned for all its tokens, while the allocation
    reuses its cached prefix blocks: computed + scheduled exceeds its length."""
    engine = FakeEngine(num_blocks=16, block_size=2, max_num_batched_tokens=4)
    engine.cache_prefix([1, 2, 3, 4, 5])  # puts [1, 2] [3, 4] in the prefix cache
    engine.arrivals += 1
    group = SequenceGroup("r", None, [1, 2, 3, 4], SamplingParams(n=2, max_tokens=8), engine.arrivals)
    sample0, sample1 = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9]), Sequence([1, 2, 3, 4, 8, 9, 10], index=1)
    for seq in (sample0, sample1):  # as after preemption: prompt plus own output, nothing computed
        seq.num_prompt_tokens = 4
    group.seqs, group.forked = [sample0, sample1], True
    engine.groups["r"] = group
    engine.beam_rng["r"] = random.Random(0)
    assert engine.sched.add(group) is None
    engine.step()
    assert engine.log[-1].scheduled == [("r", 0, 4)]  # 4 of sample 0's 5 uncached tokens
    engine.run()  # fails: sample 1 is scheduled for 4 tokens from position 4 (of 7)
    engine.assert_all_done()


def test_preempted_sampling_group_can_be_admitted_again() -> None:
    """n = 3 samples share a 4-token prompt (bs 1): 4 + 3 blocks after one token each. An
    older request's growth preempts them; recomputed without sharing they need 3 * 6 = 18
    blocks of a 12-block cache, and the queue's head is never admitted again (the engine then
    fails the request)."""
    engine = FakeEngine(num_blocks=12, block_size=1, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert engine.add("old", _prompt(2, 0), SamplingParams(max_tokens=8)) is None
    assert engine.add("samples", _prompt(4, 1), SamplingParams(n=3, max_tokens=6)) is None
    engine.run()
    engine.assert_all_done()


# ---------------------------------------------------------------------- a prefix shared by a batch
def _suffix(r: int) -> list[int]:
    """A row's own tokens (1 to 6 of them, distinct from every prefix's)."""
    return [100 + r] * (1 + r % 6)


def _together(engine: FakeEngine, prefix: list[int], rows: int, params: Params | None = None) -> list[list[int]]:
    prompts = [prefix + _suffix(r) for r in range(rows)]
    for r, prompt in enumerate(prompts):
        assert engine.add(f"r{r}", prompt, params or SamplingParams(max_tokens=3)) is None
    return prompts


@pytest.mark.parametrize("budget", [512, 24])
def test_rows_arriving_together_compute_their_shared_prefix_once(budget: int) -> None:
    """16 rows queued before the first step. The first one computes the 37-token prefix; the
    others, admitted in the same step, reuse the blocks it fills in that step. With a small
    budget the prefix is chunked over steps and nobody is admitted until its last chunk."""
    bs, prefix = 4, _prompt(37, 5)
    engine = FakeEngine(num_blocks=128, block_size=bs, max_num_batched_tokens=budget)
    _together(engine, prefix, 16)
    engine.run()
    engine.assert_all_done()
    own = sum(len(_suffix(r)) for r in range(16))
    assert engine.prefill_tokens <= len(prefix) + own + 16 * bs
    assert engine.bm.prefix_cache_hit_blocks == 15 * (len(prefix) // bs)
    if budget == 512:  # all rows fit the first step
        assert len(engine.log[0].scheduled) == 16


@pytest.mark.parametrize("policy", ["prefix", "fcfs"])
def test_interleaved_prefixes_are_each_computed_once(policy: str) -> None:
    bs, rows = 4, 18
    prefixes = [_prompt(21 + 4 * p, 11 + p) for p in range(3)]
    engine = FakeEngine(num_blocks=128, block_size=bs, max_num_batched_tokens=64, scheduling_policy=policy)
    for r in range(rows):
        assert engine.add(f"r{r}", prefixes[r % 3] + _suffix(r), SamplingParams(max_tokens=2)) is None
    engine.run()
    engine.assert_all_done()
    own = sum(len(_suffix(r)) for r in range(rows))
    assert engine.prefill_tokens <= sum(map(len, prefixes)) + own + rows * bs


def test_prefix_order_keeps_each_prefix_computed_once_in_a_cache_too_small_for_all() -> None:
    """Eight prefixes, rows interleaved, a cache that holds about two of them. In arrival
    order every row finds its prefix evicted by the others; in prefix order the rows of one
    prefix run together, so each prefix is computed about once."""
    bs, rows = 4, 48
    prefixes = [_prompt(40, 20 + p) for p in range(8)]
    computed = {}
    for policy in ("prefix", "fcfs"):
        engine = FakeEngine(num_blocks=30, block_size=bs, max_num_seqs=64, max_num_batched_tokens=64,
                            scheduling_policy=policy)
        for r in range(rows):
            assert engine.add(f"r{r}", prefixes[r % 8] + _suffix(r), SamplingParams(max_tokens=2)) is None
        engine.run()
        engine.assert_all_done()
        computed[policy] = engine.prefill_tokens
    own = sum(len(_suffix(r)) for r in range(rows))
    assert computed["prefix"] <= 8 * 40 + own + rows * bs
    assert computed["fcfs"] > 2 * computed["prefix"], computed


def _queue(engine: FakeEngine) -> list[str]:
    return [g.request_id for g in engine.sched.waiting]


def test_prefix_order_puts_rows_sharing_a_prefix_next_to_each_other() -> None:
    """Depth first over the tree of shared prompt blocks, branches in order of first arrival;
    "fcfs" keeps arrival order."""
    system = _prompt(8, 1)
    a, b = system + _prompt(8, 2), system + _prompt(8, 3)
    prompts = {"a0": a + [7], "b0": b + [7], "x": _prompt(9, 4), "a1": a + [8], "s": system + [9],
               "b1": b + [8], "a2": a + [9]}
    for policy, expected in (("prefix", ["a0", "a1", "a2", "b0", "b1", "s", "x"]),
                             ("fcfs", list(prompts))):
        engine = FakeEngine(num_blocks=64, block_size=4, scheduling_policy=policy)
        for rid, prompt in prompts.items():
            assert engine.add(rid, prompt, SamplingParams(max_tokens=1)) is None
        assert _queue(engine) == expected
        engine.run()
        engine.assert_all_done()
        assert engine.admitted == expected


def test_prefix_order_lets_at_most_lookahead_later_arrivals_pass_a_request() -> None:
    engine = FakeEngine(num_blocks=256, block_size=4, max_num_seqs=8)
    assert engine.sched.lookahead == 8
    shared = _prompt(12, 1)
    assert engine.add("a0", shared + [0], SamplingParams(max_tokens=1)) is None
    assert engine.add("lonely", _prompt(12, 2), SamplingParams(max_tokens=1)) is None
    for r in range(1, 30):
        assert engine.add(f"a{r}", shared + [r], SamplingParams(max_tokens=1)) is None
    queue = _queue(engine)
    passed = queue.index("lonely") - 1  # a0 arrived before it
    assert 1 <= passed <= engine.sched.lookahead
    engine.run()
    engine.assert_all_done()


def test_a_preempted_group_goes_back_to_the_head_of_the_queue() -> None:
    engine = FakeEngine(num_blocks=12, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert engine.add("old", _prompt(6, 0), SamplingParams(max_tokens=12)) is None
    assert engine.add("new", _prompt(4, 2), SamplingParams(max_tokens=10)) is None
    assert engine.add("later", _prompt(4, 3), SamplingParams(max_tokens=10)) is None
    while not any(step.preempted for step in engine.log):
        engine.step()
    victim = engine.log[-1].preempted[0]
    assert _queue(engine)[0] == victim
    engine.run()
    engine.assert_all_done()


@pytest.mark.parametrize("kind", ["n", "beam"])
def test_shared_prefix_with_samples_and_beams_under_eviction_and_preemption(kind: str) -> None:
    """n = 3 samples or 3 beams per row, 12 rows sharing a prefix, a cache that forces
    preemption and eviction: everything finishes, reading back the right tokens (checked each
    step), and the prefix is reused."""
    params: Params = (SamplingParams(n=3, max_tokens=6) if kind == "n"
                      else BeamSearchParams(beam_width=3, max_tokens=5))
    engine = FakeEngine(num_blocks=28, block_size=2, max_num_seqs=12, max_num_batched_tokens=48)
    _together(engine, _prompt(17, 8), 12, params)
    engine.run()
    engine.assert_all_done()
    assert not engine.errors
    assert engine.sched.num_preemptions > 0 and engine.bm.num_evictions > 0
    assert engine.bm.prefix_cache_hit_blocks > 0
