"""Stateful random test of BlockManager against an independent model of the KV cache.

A hypothesis state machine drives the block manager with random operations, the way the
engine does: admit a sequence (with a prefix-cache lookup), prefill it in chunks, decode
tokens, fork one sequence into several (n-sampling), run beam-search steps (survivors fork
from their parents, dead beams are freed), free single sequences and whole groups, preempt a
group by recompute, and admit several requests in one step, where each lookup also finds the
blocks that the requests allocated before it fill in that step (written only when the step
runs). Prompts are drawn from a two-token alphabet on top of a few
shared prefixes, so that prefix-cache hits, copy-on-write and LRU eviction all happen often
in a cache of 4 to 24 blocks.

Next to the block manager the machine keeps its own model:

* ``kv``: what every physical block holds, slot by slot. Each step applies the (src, dst)
  copies that ``allocate_slots`` returned, then writes the new tokens to the slots that the
  sequence's block table names, exactly as the engine's model runner does.
* reference counts, recomputed from the live block tables;
* the LRU order of cached free blocks (tail of a freed table first).

After every operation it checks the block manager's own ``check_invariants`` and, from the
outside: ref counts equal the live references, no block is both free and used, each
allocation takes exactly the blocks it must (fresh blocks only; an eviction only when no
plain free block is left, and then the least recently used cached block), and every live
sequence's computed tokens read back through its block table equal its token ids (so a
copy-on-write copy holds the parent's data and a prefix hit holds the right tokens). At
teardown everything is freed and every block must be free.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from batchgen.engine.block_manager import NULL_BLOCK, BlockManager
from batchgen.engine.sequence import Sequence

# Shared prompt prefixes over a tiny alphabet: most prompts start with one of them, so that
# full blocks repeat across requests and the prefix cache is hit.
PREFIXES: tuple[tuple[int, ...], ...] = (
    (0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1),
    (1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0),
    (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
)
TOKENS = st.integers(0, 1)
MAX_LIVE_SEQS = 16
MAX_GROUP_SIZE = 6

# Totals over the whole run, checked by the test function: the number of operations run and
# how often each interesting event happened (so the test cannot pass vacuously).
STATS: Counter[str] = Counter()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random engine-like use of one BlockManager, checked against a model after each rule."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.bs = 1
        self.reserve = 0
        self.window: int | None = None
        self.seqs: dict[int, Sequence] = {}  # seq_id -> live sequence
        self.groups: dict[int, list[int]] = {}  # group id -> seq ids (a request's sequences)
        self.group_of: dict[int, int] = {}  # seq_id -> group id
        self.next_group = 0
        self.kv: dict[int, list[int | None]] = {}  # block id -> token written in each slot
        self.lru: list[int] = []  # model of the cached free blocks, least recently used first
        self.peak = 0
        # While a multi-request step is planned: its writes (run when the step runs), and the
        # hits on blocks still being filled, checked once they are written.
        self.step_writes: list[tuple[Sequence, list[tuple[int, int]], int, int]] | None = None
        self.pending_hits: list[tuple[int, list[int]]] = []

    # ------------------------------------------------------------------ setup
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(4, 24),
        watermark=st.sampled_from([0.0, 0.1, 0.25]),
        window=st.sampled_from([None, None, 1, 2, 3, 5, 8]),
    )
    def setup(self, block_size: int, num_blocks: int, watermark: float, window: int | None) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, watermark=watermark, window=window)
        self.bs = block_size
        self.window = window
        self.reserve = int(watermark * num_blocks)
        self.kv = {b: [None] * block_size for b in range(num_blocks)}

    # ------------------------------------------------------------------ model helpers
    def _live(self) -> list[Sequence]:
        return list(self.seqs.values())

    def _refs(self) -> Counter[int]:
        """Table entries naming each block (the null block's entries are no references)."""
        return Counter(b for s in self.seqs.values() for b in s.block_table if not (self.window and b == NULL_BLOCK))

    def _behind(self, num_computed: int) -> int:
        """Leading blocks wholly before the window of the token at ``num_computed``."""
        return max(num_computed - self.window + 1, 0) // self.bs if self.window else 0

    def _pick(self, seqs: list[Sequence], index: int) -> Sequence:
        return sorted(seqs, key=lambda s: s.seq_id)[index % len(seqs)]

    def _pick_group(self, index: int) -> list[Sequence]:
        gid = sorted(self.groups)[index % len(self.groups)]
        return [self.seqs[i] for i in self.groups[gid]]

    def _new_group(self, seqs: list[Sequence]) -> None:
        gid = self.next_group
        self.next_group += 1
        self.groups[gid] = [s.seq_id for s in seqs]
        for s in seqs:
            self.seqs[s.seq_id] = s
            self.group_of[s.seq_id] = gid

    def _join_group(self, seq: Sequence, gid: int) -> None:
        self.seqs[seq.seq_id] = seq
        self.groups[gid].append(seq.seq_id)
        self.group_of[seq.seq_id] = gid

    def _allocate(self, seq: Sequence, n: int, hits: list[int], admit: bool) -> bool:
        """``allocate_slots`` checked against the model, then the step's copies and writes.

        Returns whether the allocation succeeded (on failure nothing may have changed).
        """
        bm, bs = self.bm, self.bs
        refs = self._refs()
        table_before = list(seq.block_table)
        computed_before = seq.num_computed_tokens
        free_before = bm.num_free_blocks
        plain_free_before = sum(
            1 for b in bm.blocks[bm.num_reserved:] if refs[b.block_id] == 0 and b.block_hash is None)

        # What the allocation must take, computed from the model alone.
        start = len(hits) * bs if hits else seq.num_computed_tokens
        table_len = len(hits) if hits else len(seq.block_table)
        end = start + n
        num_new = max(0, _ceil_div(end, bs) - table_len)
        cow = [i for i in range(start // bs, min(_ceil_div(end, bs), len(table_before)))
               if n > 0 and refs[table_before[i]] > 1]
        behind = self._behind(len(hits) * bs) if hits else 0  # hits not taken: null entries at once
        reused_free = [h for h in hits[behind:] if refs[h] == 0]
        STATS["hits_behind_window"] += behind
        expected = num_new + len(cow) + len(reused_free)

        copies = bm.allocate_slots(seq, n, hits, admit=admit)
        if copies is None:
            assert expected > free_before - (self.reserve if admit else 0), (
                f"allocation of {expected} blocks refused with {free_before} free")
            assert seq.block_table == table_before and seq.num_computed_tokens == computed_before
            assert bm.num_free_blocks == free_before, "a refused allocation changed the pool"
            STATS["refused"] += 1
            return False
        assert expected <= free_before - (self.reserve if admit else 0), (
            f"allocation of {expected} blocks granted with {free_before} free (admit={admit})")
        assert bm.num_free_blocks == free_before - expected
        assert seq.num_computed_tokens == start
        assert len(seq.block_table) == _ceil_div(end, bs)
        if hits:
            assert seq.block_table[: len(hits)] == [NULL_BLOCK] * behind + hits[behind:]

        # Copy-on-write: exactly the shared blocks the write touches, each into a fresh block.
        assert len(copies) == len(cow)
        for i, (src, dst) in zip(cow, copies):
            assert src == table_before[i] and refs[src] > 1
            assert seq.block_table[i] == dst and refs[dst] == 0 and dst not in hits
        # New blocks: taken in order (copies first, then the table's tail), all unused before.
        taken = [dst for _, dst in copies] + seq.block_table[table_len:]
        assert len(set(taken)) == len(taken)
        for b in taken:
            assert refs[b] == 0, f"block {b} handed out while used"
            assert not (self.window and b == NULL_BLOCK), "the null block was handed out"
        # Eviction: only once the plain free blocks are gone, and least recently used first.
        self.lru = [b for b in self.lru if b not in hits[behind:]]
        evicted = [b for b in taken if b in self.lru]
        assert len(evicted) == max(0, len(taken) - plain_free_before), (
            f"evicted {evicted} with {plain_free_before} plain free blocks for {len(taken)} new")
        assert evicted == self.lru[: len(evicted)], f"evicted {evicted}, LRU order is {self.lru}"
        self.lru = self.lru[len(evicted):]
        STATS["evictions"] += len(evicted)
        STATS["cow_copies"] += len(copies)

        self.peak = max(self.peak, bm.num_used_blocks)
        write = (seq, copies, start, end)
        if self.step_writes is not None:
            self.step_writes.append(write)
        else:
            self._run_step([write])
        return True

    def _run_step(self, writes: list[tuple[Sequence, list[tuple[int, int]], int, int]]) -> None:
        """The engine's step: batched block copies first, then the new tokens' K/V; then each
        sequence advances and registers its full blocks."""
        bs = self.bs
        for _, copies, _, _ in writes:
            for src, dst in copies:
                self.kv[dst] = list(self.kv[src])
        for seq, _, start, end in writes:
            for pos in range(start, end):
                self.kv[seq.block_table[pos // bs]][pos % bs] = seq.token_ids[pos]
        for seq, _, _, end in writes:
            seq.num_computed_tokens = end
            self.bm.cache_full_blocks(seq)

    def _free(self, seq: Sequence) -> None:
        """``free`` with the model's LRU update (the table's tail becomes free first)."""
        refs = self._refs()
        for b in reversed(seq.block_table):
            if self.window and b == NULL_BLOCK:
                continue
            refs[b] -= 1
            if refs[b] == 0 and self.bm.blocks[b].block_hash is not None:
                self.lru.append(b)
        self.bm.free(seq)
        assert seq.block_table == []
        del self.seqs[seq.seq_id]
        gid = self.group_of.pop(seq.seq_id)
        self.groups[gid].remove(seq.seq_id)
        if not self.groups[gid]:
            del self.groups[gid]

    def _admit(self, tokens: list[int], chunk: int, admit: bool) -> Sequence | None:
        """A fresh sequence: prefix lookup, then the first chunk. None if it did not fit."""
        bm, bs = self.bm, self.bs
        seq = Sequence(tokens)
        hits, hit_tokens = bm.get_computed_blocks(seq)
        assert hit_tokens == len(hits) * bs
        assert hit_tokens < len(tokens), "a hit must leave the last prompt token to compute"
        assert len(set(hits)) == len(hits)
        pending = set(bm._pending.values())
        for i, b in enumerate(hits):  # the hit blocks really hold this prompt's tokens
            if b in pending:  # or will, once this step's writes ran
                assert self.step_writes is not None, f"block {b} pending outside a step"
                self.pending_hits.append((b, tokens[i * bs : (i + 1) * bs]))
                STATS["pending_hits"] += 1
                continue
            assert self.kv[b] == tokens[i * bs : (i + 1) * bs], f"hit block {b} holds {self.kv[b]}"
        # The hit is the longest cached chain: the next full block is not cached.
        if len(hits) < (len(tokens) - 1) // bs:
            parent = bm.blocks[hits[-1]].block_hash if hits else None
            nxt = tuple(tokens[len(hits) * bs : (len(hits) + 1) * bs])
            assert not any(b.block_hash is not None and b.parent_hash == parent and b.token_ids == nxt
                           for b in bm.blocks), "a cached block continuing the prefix was missed"
        n = min(chunk, len(tokens) - hit_tokens)
        if not self._allocate(seq, n, hits, admit):
            return None
        bm.record_prefix_lookup(len(tokens), hit_tokens)
        STATS["hit_blocks"] += len(hits)
        return seq

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.seqs) < MAX_LIVE_SEQS)
    @rule(
        prefix=st.integers(0, len(PREFIXES)),
        prefix_len=st.integers(0, 12),
        suffix=st.lists(TOKENS, max_size=6),
        chunk=st.integers(1, 16),
        admit=st.booleans(),
    )
    def add_request(self, prefix: int, prefix_len: int, suffix: list[int], chunk: int, admit: bool) -> None:
        """A new request: prefix lookup and its first prefill chunk (prefix == 3: no prefix)."""
        tokens = (list(PREFIXES[prefix][:prefix_len]) if prefix < len(PREFIXES) else []) + suffix
        if not tokens:
            tokens = [0]
        seq = self._admit(tokens, chunk, admit)
        if seq is not None:
            self._new_group([seq])
        STATS["ops"] += 1

    @precondition(lambda self: len(self.seqs) < MAX_LIVE_SEQS - 4)
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prompts=st.lists(st.tuples(st.integers(0, 12), st.lists(TOKENS, max_size=4)), min_size=2, max_size=4),
        chunk=st.integers(1, 16),
    )
    def add_requests_together(self, prefix: int, prompts: list[tuple[int, list[int]]], chunk: int) -> None:
        """Requests sharing a prefix arrive together and are admitted in one step: each lookup
        comes after the allocations before it, whose filled blocks are pending (not yet
        written); the step then writes them all."""
        self.bm.begin_step()
        self.step_writes, self.pending_hits = [], []
        for prefix_len, suffix in prompts:
            tokens = list(PREFIXES[prefix][:prefix_len]) + suffix or [0]
            seq = self._admit(tokens, chunk, admit=True)
            if seq is not None:
                self._new_group([seq])
        writes, self.step_writes = self.step_writes, None
        self._run_step(writes)
        for block_id, tokens in self.pending_hits:
            assert self.kv[block_id] == tokens, f"pending hit {block_id} holds {self.kv[block_id]}, not {tokens}"
        STATS["ops"] += 1

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.seqs.values()))
    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 8))
    def prefill(self, index: int, chunk: int) -> None:
        """The next chunk of a sequence that still has uncomputed tokens."""
        seq = self._pick([s for s in self.seqs.values() if s.num_computed_tokens < s.num_tokens], index)
        self._allocate(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens), [], admit=False)
        STATS["ops"] += 1

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.seqs.values()))
    @rule(index=st.integers(0, 1000), token=TOKENS)
    def decode(self, index: int, token: int) -> None:
        """Append a sampled token and compute it (one slot; copy-on-write if shared)."""
        seq = self._pick([s for s in self.seqs.values() if s.num_computed_tokens == s.num_tokens], index)
        seq.append_token(token, 0.0)
        self._allocate(seq, 1, [], admit=False)
        STATS["ops"] += 1

    @precondition(lambda self: bool(self.seqs))
    @rule(index=st.integers(0, 1000), num_children=st.integers(1, 3))
    def fork_group(self, index: int, num_children: int) -> None:
        """n-sampling: one sequence forks into several children sharing all its blocks."""
        parent = self._pick(self._live(), index)
        gid = self.group_of[parent.seq_id]
        room = min(MAX_GROUP_SIZE - len(self.groups[gid]), MAX_LIVE_SEQS - len(self.seqs))
        for _ in range(min(num_children, room)):
            child = parent.fork(index=len(self.groups[gid]))
            self.bm.fork(parent, child)
            assert child.block_table == parent.block_table
            assert child.num_computed_tokens == parent.num_computed_tokens
            self._join_group(child, gid)
            STATS["forked_children"] += 1
        STATS["ops"] += 1

    @precondition(lambda self: any(all(self.seqs[i].num_computed_tokens == self.seqs[i].num_tokens
                                       for i in ids) for ids in self.groups.values()))
    @rule(index=st.integers(0, 1000),
          choices=st.lists(st.tuples(st.integers(0, 1000), TOKENS), min_size=1, max_size=4))
    def beam_step(self, index: int, choices: list[tuple[int, int]]) -> None:
        """Beam search: each new beam extends a chosen parent; a parent with several children
        is forked (the last child takes the parent itself); unchosen beams are freed at once;
        then every surviving beam computes its new token."""
        ready = [gid for gid, ids in sorted(self.groups.items())
                 if all(self.seqs[i].num_computed_tokens == self.seqs[i].num_tokens for i in ids)]
        gid = ready[index % len(ready)]
        beams = sorted((self.seqs[i] for i in self.groups[gid]), key=lambda s: s.seq_id)
        room = MAX_LIVE_SEQS - len(self.seqs) + len(beams)
        chosen = [(beams[p % len(beams)], tok) for p, tok in choices[:room]]
        remaining = Counter(id(parent) for parent, _ in chosen)
        new_beams: list[Sequence] = []
        for parent, token in chosen:
            remaining[id(parent)] -= 1
            if remaining[id(parent)] > 0:
                child = parent.fork(index=len(new_beams))
                self.bm.fork(parent, child)
                self._join_group(child, gid)
                STATS["forked_children"] += 1
            else:
                child = parent
            child.append_token(token, 0.0)
            new_beams.append(child)
        alive = {id(s) for s in new_beams}
        for beam in beams:
            if id(beam) not in alive:
                self._free(beam)
                STATS["dead_beams"] += 1
        for beam in new_beams:
            self._allocate(beam, 1, [], admit=False)
        STATS["beam_steps"] += 1
        STATS["ops"] += 1

    @precondition(lambda self: self.window is not None and bool(self.seqs))
    @rule(index=st.integers(0, 1000))
    def release(self, index: int) -> None:
        """Between steps, a sequence gives back the blocks wholly before its next token's
        window: the newest of them first (each to the LRU tail if cached), entries null."""
        seq = self._pick(self._live(), index)
        table = list(seq.block_table)
        end = min(self._behind(seq.num_computed_tokens), len(table))
        refs = self._refs()
        gone = []
        for i in range(end - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            gone.append(i)
            refs[table[i]] -= 1
            if refs[table[i]] == 0 and self.bm.blocks[table[i]].block_hash is not None:
                self.lru.append(table[i])
        assert self.bm.release_behind_window(seq) == len(gone)
        assert seq.block_table == [NULL_BLOCK if i < end else b for i, b in enumerate(table)]
        STATS["released"] += len(gone)
        STATS["ops"] += 1

    @precondition(lambda self: bool(self.seqs))
    @rule(index=st.integers(0, 1000))
    def free_seq(self, index: int) -> None:
        """A sequence finishes (a sample hit a stop) and frees its blocks at once."""
        self._free(self._pick(self._live(), index))
        STATS["ops"] += 1

    @precondition(lambda self: bool(self.groups))
    @rule(index=st.integers(0, 1000))
    def free_group(self, index: int) -> None:
        """A whole request finishes: all its sequences are freed."""
        seqs = self._pick_group(index)
        for seq in seqs:
            self._free(seq)
        STATS["groups_freed"] += 1
        STATS["ops"] += 1

    @precondition(lambda self: bool(self.groups))
    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 32))
    def preempt_and_recompute(self, index: int, chunk: int) -> None:
        """Preemption by recompute: free the whole group, then re-admit each sequence with
        its tokens so far (prompt and output), one after the other, through the prefix cache."""
        seqs = self._pick_group(index)
        for seq in seqs:
            self._free(seq)
        gid: int | None = None
        for seq in seqs:
            again = self._admit(list(seq.token_ids), chunk, admit=True)
            if again is None:
                continue
            if gid is None:  # the model must see each admitted sequence before the next one
                self._new_group([again])
                gid = self.group_of[again.seq_id]
            else:
                self._join_group(again, gid)
        STATS["preemptions"] += 1
        STATS["ops"] += 1

    # ------------------------------------------------------------------ checks
    @invariant()
    def consistent(self) -> None:
        bm, bs = self.bm, self.bs
        live = self._live()
        bm.check_invariants(live)
        assert not bm._pending, "a step ended with blocks still pending"
        refs = self._refs()
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, {refs[block.block_id]} references")
        used = {b for b, r in refs.items() if r > 0}
        assert bm.num_used_blocks == len(used), "a block is counted both free and used"
        assert bm.num_free_blocks == bm.num_usable_blocks - len(used)
        cached_free = {b.block_id for b in bm.blocks if b.ref_count == 0 and b.block_hash is not None}
        assert cached_free == set(self.lru), f"cached free blocks {cached_free}, model {self.lru}"
        assert bm.peak_blocks_used == self.peak
        # Every cached block holds the tokens it is cached under.
        for block in bm.blocks:
            if block.block_hash is not None:
                assert block.token_ids is not None
                assert self.kv[block.block_id] == list(block.token_ids), (
                    f"cached block {block.block_id} holds {self.kv[block.block_id]}, "
                    f"registered as {block.token_ids}")
        # Every live sequence reads its own tokens back through its block table: with a window,
        # those its next token attends to (entries before may be null, none after), and the null
        # block holds nothing.
        for seq in live:
            assert len(seq.block_table) == _ceil_div(seq.num_computed_tokens, bs)
            behind = self._behind(seq.num_computed_tokens)
            assert NULL_BLOCK not in seq.block_table[behind:] or not self.window
            start = behind * bs if self.window else 0
            read = [self.kv[seq.block_table[p // bs]][p % bs] for p in range(start, seq.num_computed_tokens)]
            assert read == seq.token_ids[start: seq.num_computed_tokens], (
                f"{seq} reads {read}, expected {seq.token_ids[start: seq.num_computed_tokens]}")
        if self.window:
            assert self.kv[NULL_BLOCK] == [None] * bs, "the null block was written"

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self._live():
            self._free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert set(self.lru) == {b.block_id for b in self.bm.blocks if b.block_hash is not None}


def test_block_manager_random_operations() -> None:
    """At least 10^4 random operations in total, each followed by the full check."""
    STATS.clear()
    run_state_machine_as_test(
        BlockManagerMachine,
        settings=settings(
            max_examples=400,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert STATS["ops"] >= 10_000, f"only {STATS['ops']} operations ran"
    # Every kind of event the test is about really happened, many times.
    for event in ("hit_blocks", "cow_copies", "evictions", "forked_children", "dead_beams",
                  "beam_steps", "groups_freed", "preemptions", "refused", "pending_hits", "released",
                  "hits_behind_window"):
        assert STATS[event] >= 20, f"{event} happened only {STATS[event]} times: {dict(STATS)}"
