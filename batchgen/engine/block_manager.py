"""BlockManager: physical KV blocks, ref counts, fork, copy-on-write and prefix caching.

Pure Python (no torch): it decides *which* blocks hold which tokens; the engine moves the data.

Model
-----
* The cache has ``num_blocks`` blocks of ``block_size`` token slots each.
* A sequence's ``block_table`` maps its logical block ``i`` (tokens ``i*block_size`` ..) to a
  physical block id. Blocks are taken on demand, as tokens are scheduled.
* ``ref_count`` of a block is the number of block tables holding it. A block with ref count 0
  is *free*: either plain free, or *cached* (it holds a full, hashed block of tokens that a
  later request with the same prefix may reuse) and evictable in LRU order.
* ``fork`` shares every block of the parent (ref counts go up). The first write into a shared
  block copies it (copy-on-write): ``allocate_slots`` returns the (src, dst) pairs, and the
  engine runs all pairs of a step as one batched copy before the forward pass.
* Prefix caching (:class:`~batchgen.engine.prefix_cache.PrefixCache`, whose methods the
  manager has): full blocks of tokens shared across requests by prefix hash.
* Sliding windows (``window``: a model whose every layer attends over at most ``window``
  positions, itself included: Mistral, Phi-3): a block wholly before the window of a
  sequence's next token is never read again, so ``release_behind_window`` drops it from the
  table, whose entry then names the *null block* (``NULL_BLOCK``, id 0: reserved, never handed
  out, never written, all zeros), as vLLM's sliding-window manager does. The table keeps one
  entry per logical block, so positions still map to ``i * block_size``; a sequence holds about
  ``window / block_size`` blocks however long it grows, and a full released block stays in the
  prefix cache (evictable) like any other.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from batchgen.engine.config import MAX_BLOCK_SIZE
from batchgen.engine.prefix_cache import NULL_BLOCK, Block, PrefixCache
from batchgen.engine.sequence import Sequence

__all__ = ["Block", "BlockManager", "NULL_BLOCK"]


class BlockManager(PrefixCache):
    """Allocates blocks to sequences; see the module docstring for the model.

    Args:
        num_blocks: physical blocks in the cache (>= 1).
        block_size: tokens per block, 1..256.
        enable_prefix_caching: share full blocks across requests by prefix hash.
        watermark: fraction of blocks kept free when *admitting* new sequences, so that running
            sequences can keep growing without immediate preemption.
        window: the positions every layer attends over (None: some layer sees the whole
            context); with a window, block ``NULL_BLOCK`` is reserved and blocks behind it are
            released (see the module docstring).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        window: int | None = None,
    ) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.window = window
        self.num_reserved = 1 if window else 0  # the null block
        if num_blocks < 1 + self.num_reserved:
            raise ValueError(f"num_blocks must be >= {1 + self.num_reserved}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(self.num_reserved, num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._pending: dict[int, int] = {}  # block hash -> block id, filled by this step
        # Statistics.
        self.num_cow_copies = 0
        self.peak_blocks_used = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found (cached or pending)
        self.prefix_cache_hit_blocks = 0  # blocks found
        self.num_evictions = 0  # cached blocks taken back for other contents
        self.num_released_blocks = 0  # table entries released behind a sliding window

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that sequences can hold: all but the null block."""
        return self.num_blocks - self.num_reserved

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def most_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds at once when each step
        computes at most ``max_chunk`` of them: all of them without a window; with one, the
        blocks from its oldest query's window start to its newest token."""
        full = self.num_blocks_for(num_tokens)
        if not self.window:
            return full
        return min(full, (self.window - 1 + min(max_chunk, num_tokens)) // self.block_size + 2)

    def can_allocate(self, num_new_blocks: int, *, admit: bool) -> bool:
        """Whether ``num_new_blocks`` can be taken now; admissions keep the watermark free."""
        reserve = self.watermark_blocks if admit else 0
        return num_new_blocks <= self.num_free_blocks - reserve

    # ------------------------------------------------------------------ mutations
    def _take_free_block(self) -> int:
        """A block with ref count 1, from the free list first, else the LRU cached one."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            self.num_evictions += 1
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # A cached block coming back into use.
            del self._evictable[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if self._is_cached(block):
                self._evictable[block_id] = None  # most recently used at the end
            else:
                self._uncache(block_id)
                self._free.append(block_id)

    def _cow_indices(self, seq: Sequence, start: int, num_new_tokens: int) -> list[int]:
        """Logical indices of ``seq``'s shared blocks that writing tokens
        ``start .. start + num_new_tokens`` touches: each must be copied first."""
        if num_new_tokens <= 0:
            return []
        first, last = start // self.block_size, (start + num_new_tokens - 1) // self.block_size
        return [i for i in range(first, min(last + 1, len(seq.block_table)))
                if self.blocks[seq.block_table[i]].ref_count > 1]

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> int:
        """Free blocks that ``allocate_slots`` with the same arguments would take."""
        return self.num_blocks_needed_for_group([(seq, num_new_tokens, computed_blocks or [])])

    def num_blocks_needed_for_group(self, plan: list[tuple[Sequence, int, list[int]]]) -> int:
        """Free blocks that ``take_computed_blocks`` then ``allocate_slots`` for every
        (sequence, new tokens, prefix hits) of ``plan``, in order, would take: exact, so that
        a group is allocated all or nothing.

        A block shared by ``r`` tables and written by ``w`` of the planned sequences is copied
        ``w`` times if ``r > w``, else ``w - 1`` times (the last writer owns it by then).
        """
        bs = self.block_size
        total = 0
        writers: dict[int, int] = {}
        reused_free: set[int] = set()
        for seq, num_new_tokens, hits in plan:
            start = len(hits) * bs if hits else seq.num_computed_tokens
            table_len = len(hits) if hits else len(seq.block_table)
            end = start + num_new_tokens
            total += max(0, self.num_blocks_for(end) - table_len)
            reused_free.update(b for b in hits[self.blocks_behind_window(start):] if self.blocks[b].ref_count == 0)
            if num_new_tokens > 0 and not hits:
                for i in range(start // bs, min((end - 1) // bs + 1, len(seq.block_table))):
                    block_id = seq.block_table[i]
                    writers[block_id] = writers.get(block_id, 0) + 1
        for block_id, w in writers.items():
            r = self.blocks[block_id].ref_count
            if r > 1:
                total += w if r > w else w - 1
        return total + len(reused_free)

    def take_computed_blocks(self, seq: Sequence, computed_blocks: list[int]) -> None:
        """Head ``seq``'s (empty) table with its prefix-cache hits and count them computed.

        Taking the references first pins the hits, so that later allocations of the same
        step cannot evict them. Hits wholly behind the window of the first token computed are
        not taken: their entries are ``NULL_BLOCK`` at once (a cached prefix may be longer than
        the whole cache holds beside the first chunk).
        """
        assert not seq.block_table, "prefix hits only for a fresh sequence"
        behind = self.blocks_behind_window(len(computed_blocks) * self.block_size)
        for block_id in computed_blocks[behind:]:
            self._ref(block_id)
        seq.block_table = [NULL_BLOCK] * behind + list(computed_blocks[behind:])
        seq.num_computed_tokens = len(computed_blocks) * self.block_size

    def blocks_behind_window(self, position: int) -> int:
        """How many leading blocks lie wholly before the window of the token at ``position``
        (0 without a window): what no token from there on attends to."""
        if not self.window:
            return 0
        return max(position - self.window + 1, 0) // self.block_size

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        *,
        admit: bool = False,
    ) -> list[tuple[int, int]] | None:
        """Make ``seq``'s table cover the tokens it will have computed after this step.

        For a sequence with an empty table, ``computed_blocks`` are its prefix-cache hits
        (from ``get_computed_blocks``): on success they head its table and
        ``seq.num_computed_tokens`` becomes the number of tokens they cover. The step then
        writes ``num_new_tokens`` tokens from ``seq.num_computed_tokens`` on. Writing into a
        block shared with another sequence copies it first (copy-on-write).

        Args:
            admit: True when admitting a waiting sequence; keeps the watermark free.

        Returns:
            The copy-on-write (src, dst) block pairs this write needs (possibly empty), or None
            when there are not enough free blocks, in which case nothing changed.
        """
        hits = computed_blocks or []
        assert not hits or not seq.block_table, "prefix hits only for a fresh sequence"
        if not self.can_allocate(self.num_blocks_needed(seq, num_new_tokens, hits), admit=admit):
            return None
        if hits:
            self.take_computed_blocks(seq, hits)
        start = seq.num_computed_tokens
        cow = self._cow_indices(seq, start, num_new_tokens)
        copies: list[tuple[int, int]] = []
        for i in cow:
            src = seq.block_table[i]
            dst = self._take_free_block()
            self._unref(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        while len(seq.block_table) < self.num_blocks_for(start + num_new_tokens):
            seq.block_table.append(self._take_free_block())
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        self._register_pending(seq, start, start + num_new_tokens)
        return copies

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """Share ``parent``'s blocks with ``child`` (whose table must be empty): all of them,
        or only those holding the first ``num_tokens`` tokens."""
        assert not child.block_table
        shared = parent.block_table if num_tokens is None else parent.block_table[: self.num_blocks_for(num_tokens)]
        for block_id in shared:
            if not self.is_null(block_id):
                self._ref(block_id)
        child.block_table = list(shared)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first, so that a prefix's tail is evicted
        before its head (the head is the part most likely to be shared again)."""
        for block_id in reversed(seq.block_table):
            if not self.is_null(block_id):
                self._unref(block_id)
        seq.block_table = []

    def release_behind_window(self, seq: Sequence) -> int:
        """Release ``seq``'s blocks that no later token can attend to (every position before
        the window of its next token, ``num_computed_tokens``), their entries becoming
        ``NULL_BLOCK``; returns how many. Without a window, nothing."""
        end = min(self.blocks_behind_window(seq.num_computed_tokens), len(seq.block_table))
        released = 0
        for i in range(end - 1, -1, -1):  # newest first: the older ones went in earlier steps
            block_id = seq.block_table[i]
            if self.is_null(block_id):
                break
            self._unref(block_id)
            seq.block_table[i] = NULL_BLOCK
            released += 1
        self.num_released_blocks += released
        return released

    # ------------------------------------------------------------------ checks
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Assert the block manager's invariants against the live sequences.

        * each block's ref count equals the number of table entries naming it;
        * a block is in exactly one of: used (ref > 0), plain free, evictable; but the null
          block (with a window), in none, with ref count 0 and no hash;
        * free blocks carry no hash; evictable ones are cached under their own hash;
        * every cached or pending hash maps to a block that carries that hash; a pending block
          is in use (its writer holds it) and not cached.
        """
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable, "block both free and evictable"
        if self.num_reserved:
            null = self.blocks[NULL_BLOCK]
            assert null.ref_count == 0 and null.block_hash is None, "the null block was taken or hashed"
            assert NULL_BLOCK not in free and NULL_BLOCK not in evictable, "the null block is on a free list"
        for block in self.blocks[self.num_reserved:]:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} references")
            in_use = block.ref_count > 0
            assert in_use + (block.block_id in free) + (block.block_id in evictable) == 1, (
                f"block {block.block_id} is in {'used ' * in_use}"
                f"{'free ' * (block.block_id in free)}{'evictable' * (block.block_id in evictable)}")
            if block.block_id in free:
                assert block.block_hash is None, f"free block {block.block_id} still hashed"
            if block.block_id in evictable:
                assert self._cached.get(block.block_hash) == block.block_id
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h
        for h, block_id in self._pending.items():
            assert self.blocks[block_id].block_hash == h, f"pending block {block_id} lost its hash"
            assert self.blocks[block_id].ref_count > 0, f"pending block {block_id} is free"
            assert h not in self._cached, f"block hash of {block_id} both pending and cached"
