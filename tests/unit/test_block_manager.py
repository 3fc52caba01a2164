"""Targeted tests of BlockManager: bounds, allocation, free order and LRU eviction, fork and
copy-on-write, prefix caching (cap, collisions), the admission watermark and statistics.

Each test drives the block manager the way the engine does: ``allocate_slots`` for the tokens
a step computes, then ``num_computed_tokens`` advances and ``cache_full_blocks`` registers the
full blocks.
"""

from __future__ import annotations

import builtins

import pytest

import batchgen.engine.prefix_cache as prefix_cache_module  # where the block hashes are taken
from batchgen.engine.block_manager import NULL_BLOCK, BlockManager
from batchgen.engine.sequence import Sequence


def step(bm: BlockManager, seq: Sequence, n: int, hits: list[int] | None = None, *,
         admit: bool = False) -> list[tuple[int, int]]:
    """Allocate slots for ``n`` tokens of ``seq``, then mark them computed (as the engine does)."""
    copies = bm.allocate_slots(seq, n, hits, admit=admit)
    assert copies is not None, f"allocation of {n} tokens failed for {seq}"
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return copies


def admit(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A new sequence fully prefilled through a prefix-cache lookup."""
    seq = Sequence(tokens)
    hits, hit_tokens = bm.get_computed_blocks(seq)
    bm.record_prefix_lookup(len(tokens), hit_tokens)
    step(bm, seq, len(tokens) - hit_tokens, hits, admit=True)
    return seq


def decode(bm: BlockManager, seq: Sequence, token: int) -> list[tuple[int, int]]:
    """Append one generated token and compute it."""
    seq.append_token(token, 0.0)
    return step(bm, seq, 1)


# ---------------------------------------------------------------------- construction
@pytest.mark.parametrize("block_size", [1, 2, 16, 255, 256])
def test_block_size_in_range_is_accepted(block_size: int) -> None:
    bm = BlockManager(num_blocks=4, block_size=block_size)
    assert bm.block_size == block_size
    seq = Sequence(list(range(block_size + 1)))
    step(bm, seq, seq.num_tokens)
    assert len(seq.block_table) == 2  # one full block and one holding the last token


def test_block_size_defaults_to_16() -> None:
    assert BlockManager(num_blocks=4).block_size == 16


@pytest.mark.parametrize("block_size", [0, -1, 257, 1024])
def test_block_size_out_of_range_is_rejected(block_size: int) -> None:
    with pytest.raises(ValueError, match=f"block_size must be between 1 and 256, got {block_size}"):
        BlockManager(num_blocks=4, block_size=block_size)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_num_blocks_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be >= 1, got {num_blocks}"):
        BlockManager(num_blocks=num_blocks, block_size=4)


# ---------------------------------------------------------------------- allocate / append / free
def test_blocks_are_taken_on_demand_as_tokens_are_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    seq = Sequence(list(range(10)))
    step(bm, seq, 3)  # chunked prefill: one block for tokens 0..2
    assert len(seq.block_table) == 1 and bm.num_used_blocks == 1
    step(bm, seq, 7)  # the rest: tokens 3..9 need blocks 1 and 2
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    assert len(set(seq.block_table)) == 3
    decode(bm, seq, 10)  # slot 10 and 11 fit the partial last block
    decode(bm, seq, 11)
    assert len(seq.block_table) == 3
    decode(bm, seq, 12)  # token 12 opens a fourth block
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, watermark=0.0)
    other = Sequence([1, 2, 3])
    step(bm, other, 3)
    seq = Sequence([5, 6, 7, 8, 9])
    assert bm.num_blocks_needed(seq, 5) == 3
    assert bm.allocate_slots(seq, 5) is None
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 1
    bm.check_invariants([other])
    assert bm.allocate_slots(seq, 2) == []  # a smaller chunk fits
    assert len(seq.block_table) == 1


def test_free_releases_the_tail_first_so_lru_evicts_a_prefix_tail_before_its_head() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5, 6, 7])  # blocks: [1,2] [3,4] [5,6] full, [7] partial
    head, middle, tail, partial = a.block_table
    bm.free(a)
    assert bm.num_free_blocks == 4
    # Only the partial block is plain free; the three full blocks are cached.
    assert [bm.blocks[b].block_hash is not None for b in (head, middle, tail, partial)] == [
        True, True, True, False]
    b = admit(bm, [9, 9])  # takes the plain free block first: nothing is evicted
    assert b.block_table == [partial]
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5, 6, 7]))[0] == [head, middle, tail]
    c = admit(bm, [8, 8])  # now one cached block must go: the tail, not the head
    assert c.block_table == [tail]
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5, 6, 7]))[0] == [head, middle]
    d = admit(bm, [7, 7])
    assert d.block_table == [middle]
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5, 6, 7]))[0] == [head]
    bm.check_invariants([b, c, d])


def test_lru_eviction_order_across_sequences_and_reuse_refreshes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    a = admit(bm, [1, 1])  # one full block each, cached once computed
    b = admit(bm, [2, 2])
    c = admit(bm, [3, 3])
    a_block, b_block, c_block = a.block_table[0], b.block_table[0], c.block_table[0]
    for seq in (a, b, c):
        bm.free(seq)
    # a was freed first (least recently used); a prefix hit on it makes it the most recent.
    again = admit(bm, [1, 1, 5])
    assert again.block_table[0] == a_block
    bm.free(again)
    # The next three single-block allocations must evict b, then c, then a (plain free first).
    takers = [admit(bm, [7, t]) for t in range(4)]
    order = [s.block_table[0] for s in takers]
    assert set(order[:1]).isdisjoint({a_block, b_block, c_block})  # the plain free block first
    assert order[1:] == [b_block, c_block, a_block]
    bm.check_invariants(takers)


def test_cached_blocks_are_kept_while_plain_free_blocks_remain() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5])
    bm.free(a)
    filler = admit(bm, [9, 8, 7, 6, 5, 4])  # 3 of the 4 plain free blocks
    hits, hit_tokens = bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5]))
    assert hit_tokens == 4 and len(hits) == 2
    assert set(hits).isdisjoint(filler.block_table)


# ---------------------------------------------------------------------- fork and copy-on-write
def test_fork_shares_every_block_including_the_partial_last_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    parent = admit(bm, list(range(10)))  # 2 full blocks + 1 partial (2 of 4 slots)
    free_before = bm.num_free_blocks
    children = [parent.fork(index=i) for i in range(1, 4)]
    for child in children:
        bm.fork(parent, child)
        assert child.block_table == parent.block_table
    assert bm.num_free_blocks == free_before  # forking takes no block
    for block_id in parent.block_table:
        assert bm.blocks[block_id].ref_count == 4
    bm.check_invariants([parent, *children])


def test_first_write_into_shared_partial_block_copies_only_that_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    parent = admit(bm, list(range(10)))
    child = parent.fork(index=1)
    bm.fork(parent, child)
    table = list(parent.block_table)
    copies = decode(bm, child, 100)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == table[-1] and dst not in table
    assert child.block_table == table[:-1] + [dst]  # the full blocks stay shared
    assert parent.block_table == table
    assert [bm.blocks[b].ref_count for b in table] == [2, 2, 1]
    assert bm.num_cow_copies == 1
    # The parent now owns its partial block alone: its next write copies nothing.
    assert decode(bm, parent, 200) == []
    assert parent.block_table == table and bm.num_cow_copies == 1
    # A write that opens a new block copies nothing either.
    decode(bm, child, 101)
    assert decode(bm, child, 102) == [] and len(child.block_table) == 4
    bm.check_invariants([parent, child])


def test_group_fork_copies_once_per_extra_sharer() -> None:
    """n samples sharing one partial block: n - 1 copies; the last writer keeps the original."""
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    parent = admit(bm, list(range(6)))
    seqs = [parent]
    for i in range(1, 4):
        child = parent.fork(index=i)
        bm.fork(parent, child)
        seqs.append(child)
    partial = parent.block_table[-1]
    all_copies = [decode(bm, s, 50 + i) for i, s in enumerate(seqs)]
    assert [len(c) for c in all_copies] == [1, 1, 1, 0]
    assert all(src == partial for c in all_copies for src, _ in c)
    assert seqs[-1].block_table[-1] == partial and bm.blocks[partial].ref_count == 1
    assert len({s.block_table[-1] for s in seqs}) == 4
    assert bm.num_cow_copies == 3
    bm.check_invariants(seqs)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_fork_with_full_last_block_needs_no_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    parent = admit(bm, list(range(8)))
    child = parent.fork(index=1)
    bm.fork(parent, child)
    assert bm.num_blocks_needed(child, 0) == 0
    child.append_token(9, 0.0)
    assert bm.num_blocks_needed(child, 1) == 1
    assert step(bm, child, 1) == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3
    assert bm.num_cow_copies == 0


def test_num_blocks_needed_counts_copies_and_reused_cached_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5])
    b = a.fork(index=1)
    bm.fork(a, b)
    b.append_token(6, 0.0)
    assert bm.num_blocks_needed(b, 1) == 1  # the copy of the shared partial block
    bm.free(a)
    bm.free(b)
    fresh = Sequence([1, 2, 3, 4, 9, 9])
    hits, _ = bm.get_computed_blocks(fresh)
    assert len(hits) == 2
    # Two cached free blocks come back into use, plus one new block for [9, 9].
    free_before = bm.num_free_blocks
    assert bm.num_blocks_needed(fresh, 2, hits) == 3
    step(bm, fresh, 2, hits)
    assert bm.num_free_blocks == free_before - 3


# ---------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_prefix_hit_is_capped_to_leave_the_last_prompt_token(num_blocks_in_prompt: int) -> None:
    bs = 4
    bm = BlockManager(num_blocks=16, block_size=bs, watermark=0.0)
    prompt = list(range(num_blocks_in_prompt * bs))
    first = admit(bm, prompt)
    # Same prompt of exactly k full blocks: only k - 1 blocks hit, the last block is recomputed.
    again = Sequence(prompt)
    hits, hit_tokens = bm.get_computed_blocks(again)
    assert hits == first.block_table[: num_blocks_in_prompt - 1]
    assert hit_tokens == (num_blocks_in_prompt - 1) * bs
    # One token longer: all k blocks hit.
    longer = Sequence(prompt + [99])
    hits, hit_tokens = bm.get_computed_blocks(longer)
    assert hits == first.block_table and hit_tokens == num_blocks_in_prompt * bs


def test_prefix_hit_with_block_size_one_and_a_single_token_prompt() -> None:
    bm = BlockManager(num_blocks=4, block_size=1, watermark=0.0)
    admit(bm, [7])
    assert bm.get_computed_blocks(Sequence([7])) == ([], 0)
    assert bm.get_computed_blocks(Sequence([7, 8]))[1] == 1


def test_prefix_hit_sets_computed_tokens_and_shares_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0.0)
    a = admit(bm, list(range(10)))
    b = Sequence(list(range(8)) + [50, 51, 52])
    hits, hit_tokens = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2] and hit_tokens == 8
    step(bm, b, b.num_tokens - hit_tokens, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    bm.check_invariants([a, b])
    # A different first block breaks the chain, even though the second block's tokens match.
    c = Sequence([0, 0, 0, 0] + list(range(4, 8)) + [1])
    assert bm.get_computed_blocks(c) == ([], 0)


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    a = Sequence(list(range(8)))
    step(bm, a, 6)  # block 1 is only half computed
    assert bm.get_computed_blocks(Sequence(list(range(8)) + [1]))[1] == 4
    step(bm, a, 2)
    assert bm.get_computed_blocks(Sequence(list(range(8)) + [1]))[1] == 8


# ---------------------------------------------------------------------- blocks filled in this step
def test_blocks_a_step_fills_are_found_by_lookups_in_the_same_step() -> None:
    """Rows arriving together: the second is planned while the first's prefix is only being
    written. It reuses those blocks (the step writes all K/V before any attention reads it)."""
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0.0)
    a = Sequence(list(range(10)))
    assert bm.allocate_slots(a, 10, admit=True) == []  # planned, not computed yet
    b = Sequence(list(range(9)) + [50, 51])
    hits, hit_tokens = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2] and hit_tokens == 8  # a's two full blocks, pending
    assert bm.allocate_slots(b, b.num_tokens - hit_tokens, hits, admit=True) == []
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    bm.check_invariants([a, b])
    # The step runs: both advance and register; the pending blocks become cached ones.
    for seq, n in ((b, 3), (a, 10)):
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
    assert not bm._pending
    assert bm.get_computed_blocks(Sequence(list(range(9)) + [7]))[0] == a.block_table[:2]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_a_partially_filled_block_is_not_pending() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0.0)
    a = Sequence(list(range(12)))
    assert bm.allocate_slots(a, 6) == []  # block 0 full, block 1 half
    assert bm.get_computed_blocks(Sequence(list(range(12))))[1] == 4
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert bm.allocate_slots(a, 5) == []  # completes block 1 only
    assert bm.get_computed_blocks(Sequence(list(range(12))))[1] == 8


def test_pending_blocks_of_a_step_that_did_not_run_are_dropped() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)
    a = Sequence([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5) == []
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 9]))[1] == 4
    bm.begin_step()  # the next step starts, and a's tokens were never computed
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 9])) == ([], 0)
    assert all(bm.blocks[b].block_hash is None for b in a.block_table)
    bm.check_invariants([a])
    # Computed later, the blocks register as usual.
    assert bm.allocate_slots(a, 5) == []
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 9]))[0] == a.block_table[:2]


def test_freeing_a_pending_block_unregisters_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)
    a = Sequence([1, 2, 3])
    assert bm.allocate_slots(a, 3) == []
    bm.free(a)
    assert bm.get_computed_blocks(Sequence([1, 2, 3])) == ([], 0)
    assert bm.num_free_blocks == 8 and not bm._evictable
    bm.check_invariants([])


def test_a_duplicate_written_in_the_same_step_stays_private() -> None:
    """Two sequences fill the same content into different blocks in one step (the second did
    not look the first up): one block is cached, the other stays private and is freed plainly."""
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)
    a, b = Sequence([1, 2, 3]), Sequence([1, 2, 4])
    assert bm.allocate_slots(a, 3) == [] and bm.allocate_slots(b, 3) == []
    for seq in (b, a):
        seq.num_computed_tokens = 3
        bm.cache_full_blocks(seq)
    assert bm.get_computed_blocks(Sequence([1, 2, 5]))[0] == a.block_table[:1]
    bm.check_invariants([a, b])
    duplicate = b.block_table[0]
    assert duplicate != a.block_table[0]
    bm.free(b)
    assert bm.blocks[duplicate].block_hash is None and duplicate in bm._free
    bm.check_invariants([a])


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5])
    assert bm.reset_prefix_cache() is False  # blocks in use: nothing changes
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 9]))[1] == 4
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 9])) == ([], 0)
    assert bm.num_free_blocks == 8 and not bm._evictable
    bm.check_invariants([])


def test_prefix_caching_disabled_never_hits_and_frees_plainly() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5])
    assert all(bm.blocks[b].block_hash is None for b in a.block_table)
    bm.free(a)
    assert bm.get_computed_blocks(Sequence([1, 2, 3, 4, 5])) == ([], 0)


def test_hash_collision_does_not_reuse_blocks_with_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that collides on every block, equal hashes with different tokens must not
    be reused, and blocks with equal tokens still are."""
    monkeypatch.setattr(prefix_cache_module, "hash", lambda _key: 12345, raising=False)
    bm = BlockManager(num_blocks=16, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 5])
    assert bm.blocks[a.block_table[0]].block_hash == 12345  # the patched hash is in use
    other = Sequence([8, 9, 3, 4, 5])
    assert bm.get_computed_blocks(other) == ([], 0)
    step(bm, other, other.num_tokens)
    assert set(other.block_table).isdisjoint(a.block_table)
    # The colliding block stays private and does not replace the cached one.
    same = Sequence([1, 2, 6, 6, 6])
    hits, hit_tokens = bm.get_computed_blocks(same)
    assert hits == a.block_table[:1] and hit_tokens == 2
    bm.check_invariants([a, other])


def test_hash_collision_on_second_block_stops_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hash that ignores the parent: the same tokens after a different prefix collide."""
    real_hash = builtins.hash
    monkeypatch.setattr(prefix_cache_module, "hash", lambda key: real_hash(key[1]), raising=False)
    bm = BlockManager(num_blocks=16, block_size=2, watermark=0.0)
    a = admit(bm, [1, 2, 3, 4, 0])
    b = admit(bm, [5, 6, 1, 2, 3, 4, 0])  # its block [1, 2] collides with a's first block
    hits, _ = bm.get_computed_blocks(Sequence([5, 6, 1, 2, 3, 4, 0]))
    assert hits[:1] == b.block_table[:1]
    for block_id in hits:  # whatever is reused holds this prompt's tokens in this position
        assert block_id not in a.block_table
    bm.check_invariants([a, b])


# ---------------------------------------------------------------------- watermark
def test_watermark_applies_to_admission_only() -> None:
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(90, admit=True) and not bm.can_allocate(91, admit=True)
    assert bm.can_allocate(100, admit=False) and not bm.can_allocate(101, admit=False)
    seq = Sequence(list(range(91)))
    assert bm.allocate_slots(seq, 91, admit=True) is None
    assert seq.block_table == [] and bm.num_free_blocks == 100
    step(bm, seq, 90, admit=True)
    running = Sequence(list(range(5)))
    # A running sequence may dig into the watermark.
    assert bm.allocate_slots(running, 5, admit=False) == []
    assert bm.num_free_blocks == 5
    bm.check_invariants([seq, running])


# ---------------------------------------------------------------------- statistics
def test_statistics() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0.0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_cow_copies, bm.peak_blocks_used) == (0, 0, 0, 0)
    a = admit(bm, list(range(10)))  # 10 tokens looked up, none found
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    b = admit(bm, list(range(9)))  # 9 looked up, 8 found (two full blocks)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.prefix_cache_hit_blocks) == (19, 8, 2)
    assert bm.peak_blocks_used == 4  # a: 3 blocks, b: 1 new block beyond the 2 shared
    c = a.fork(index=1)
    bm.fork(a, c)
    decode(bm, c, 1)
    assert bm.num_cow_copies == 1 and bm.peak_blocks_used == 5
    for seq in (a, b, c):
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.peak_blocks_used == 5  # the peak is kept
    # Evictions: cached blocks taken back for new contents (only once no plain block is left).
    assert bm.num_evictions == 0 and len(bm._evictable) == 2  # a's two full blocks
    step(bm, Sequence([99] * 60), 60)  # 15 blocks: the 14 plain free ones, then one eviction
    assert bm.num_evictions == 1


# ---------------------------------------------------------------------- the invariant check itself
def test_check_invariants_detects_corruption() -> None:
    """The check the stateful test relies on fails on each kind of corruption."""
    def fresh() -> tuple[BlockManager, Sequence]:
        bm = BlockManager(num_blocks=6, block_size=2, watermark=0.0)
        seq = admit(bm, [1, 2, 3])
        bm.check_invariants([seq])
        return bm, seq

    bm, seq = fresh()
    bm.blocks[seq.block_table[0]].ref_count += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_count 2 != 1 references"):
        bm.check_invariants([seq])
    bm, seq = fresh()
    with pytest.raises(AssertionError, match="ref_count 1 != 0 references"):
        bm.check_invariants([])  # a live sequence the caller forgot
    bm, seq = fresh()
    bm._free.append(seq.block_table[1])  # a used block also on the free list
    with pytest.raises(AssertionError, match=f"block {seq.block_table[1]} is in used free"):
        bm.check_invariants([seq])
    bm, seq = fresh()
    bm.free(seq)
    cached = bm.get_computed_blocks(Sequence([1, 2, 3]))[0][0]
    bm._free.append(cached)  # a cached free block also on the plain free list
    with pytest.raises(AssertionError, match="block both free and evictable"):
        bm.check_invariants([])


# ---------------------------------------------------------------------- sliding windows
def test_a_window_reserves_the_null_block_and_releases_what_no_later_token_reads() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, window=6)
    assert bm.num_usable_blocks == bm.num_free_blocks == 9 and bm.num_used_blocks == 0
    seq = Sequence(list(range(17)))
    step(bm, seq, 17)  # blocks for positions 0..19; the next token (17) sees 12..17
    held = list(seq.block_table)
    assert NULL_BLOCK not in held and len(held) == 5
    assert bm.release_behind_window(seq) == 3  # blocks of 0..3, 4..7, 8..11
    assert seq.block_table == [NULL_BLOCK] * 3 + held[3:]
    assert bm.num_used_blocks == 2 and bm.num_released_blocks == 3
    assert bm.release_behind_window(seq) == 0  # nothing more until the window moves
    bm.check_invariants([seq])
    for token in range(17, 21):
        decode(bm, seq, token)
    assert bm.release_behind_window(seq) == 1  # the next token (21) sees 16..21: 12..15 goes
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants([])


def test_released_blocks_are_shared_by_forks_and_stay_in_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, window=4)
    prompt = list(range(13))
    parent = admit(bm, prompt)
    first = parent.block_table[0]
    bm.release_behind_window(parent)  # the next token (13) sees 10..13: blocks 0 and 1 go
    assert parent.block_table[:2] == [NULL_BLOCK] * 2
    child = parent.fork(index=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    bm.check_invariants([parent, child])
    other = Sequence(prompt[:8] + [99, 98])  # the released, full blocks are still cached
    hits, hit_tokens = bm.get_computed_blocks(other)
    assert hit_tokens == 8 and hits[0] == first
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_most_blocks_held_is_a_window_and_a_chunk_with_one() -> None:
    plain, windowed = BlockManager(64, 4), BlockManager(64, 4, window=8)
    assert plain.most_blocks_held(1000, 16) == 250
    assert windowed.most_blocks_held(1000, 16) == (7 + 16) // 4 + 2
    assert windowed.most_blocks_held(5, 16) == 2  # never more than the tokens' own blocks
    with pytest.raises(ValueError, match="window must be >= 1"):
        BlockManager(8, 4, window=0)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockManager(1, 4, window=4)


def test_prefix_hits_behind_the_first_window_are_not_taken() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    first = admit(bm, list(range(20)))  # 5 blocks, all full and cached once freed
    bm.free(first)
    second = Sequence(list(range(20)) + [7, 7])
    hits, hit_tokens = bm.get_computed_blocks(second)
    assert hit_tokens == 20 and len(hits) == 5
    # the token at 20 sees 15..20: hits 3 and 4 come out of the pool, and one new block (not 5 + 1)
    assert bm.num_blocks_needed(second, 2, hits) == 3
    bm.take_computed_blocks(second, hits)
    assert second.block_table == [NULL_BLOCK] * 3 + hits[3:] and second.num_computed_tokens == 20
    assert [bm.blocks[b].ref_count for b in hits] == [0, 0, 0, 1, 1]
    bm.check_invariants([second])
