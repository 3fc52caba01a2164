"""PrefixCache: the prefix-cache half of :class:`~batchgen.engine.block_manager.BlockManager`
(its base class): block hashes, lookups, the blocks a step fills, and caching full blocks.

It keeps no state of its own: its methods read and write the manager's blocks (``blocks``,
``block_size``, ``enable_prefix_caching``), its ``_cached`` (hash -> block id) and ``_pending``
(hash -> block id, filled by this step) maps, ``_evictable`` and ``_free`` (see the manager's
``__init__``), and its statistics.

* A full block of tokens has the hash ``hash((parent_hash, tokens))``; once its tokens are
  all computed it is *cached* under that hash, and a new sequence reuses the longest chain of
  cached blocks whose hashes *and* tokens match (the token check guards against hash
  collisions). A hit is capped so that at least the last prompt token is computed (its logits
  are needed).
* Blocks filled in the current step are *pending*: ``allocate_slots`` registers every full
  block that the step's write completes, and a lookup later in the same step hits them as if
  they were cached. This is sound because a step writes all of its K/V into the cache before
  any attention reads it (see ``engine/paged_attention.py``), so a sequence scheduled in the same
  step reads the prefix that another one computes. ``cache_full_blocks`` turns them into
  cached blocks after the step; ``begin_step`` drops whatever a step did not compute.
  A pending block must be written: the scheduler never frees a sequence in the step it
  planned it (a preemption victim is always a group not yet planned in that step), and
  freeing a pending block's last reference unregisters it.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.sequence import Sequence

__all__ = ["Block", "NULL_BLOCK", "PrefixCache"]

NULL_BLOCK = 0
"""The table entry of a block released behind a sliding window: a reserved block, never handed
out or written (see :mod:`batchgen.engine.block_manager`)."""


@dataclass
class Block:
    """One physical block. ``block_hash``/``token_ids``/``parent_hash`` are set while cached."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class PrefixCache:
    """The prefix-cache methods of :class:`~batchgen.engine.block_manager.BlockManager`; see
    the module docstring."""

    def block_hashes_of(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Prefix-cache hashes of ``seq``'s first ``num_blocks`` full blocks of tokens, computed
        or not: block ``i``'s hash covers its tokens and block ``i - 1``'s hash.

        Kept on the sequence (``token_block_hashes``), so each block is hashed once; returns
        that list, at least ``num_blocks`` long (read it, do not change it).
        """
        chain = seq.token_block_hashes
        if len(chain) < num_blocks:
            bs = self.block_size
            assert num_blocks * bs <= seq.num_tokens, "only full blocks have a hash"
            # the chain starts from the adapter, so KV is shared only under one adapter
            parent = chain[-1] if chain else (("lora", seq.lora_int_id) if seq.lora_int_id else None)
            tokens = seq.token_ids
            for i in range(len(chain), num_blocks):
                parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
                chain.append(parent)
        return chain

    def get_computed_blocks(self, seq: Sequence, max_num_tokens: int | None = None) -> tuple[list[int], int]:
        """Longest run of cached (or pending) full blocks matching the start of ``seq``'s tokens.

        Looks only; takes no references. Returns (block ids, number of tokens they cover).
        The hit never covers the last token of ``seq`` (its logits must be computed), nor more
        than ``max_num_tokens`` tokens when given.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = seq.num_tokens - 1 if max_num_tokens is None else min(seq.num_tokens - 1, max_num_tokens)
        max_blocks = limit // bs
        if max_blocks <= 0:
            return [], 0
        chain = self.block_hashes_of(seq, max_blocks)
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            h = chain[i]
            block_id = self._cached.get(h)
            if block_id is None:
                block_id = self._pending.get(h)
                if block_id is None:
                    break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break  # a hash collision: different content under the same hash
            hits.append(block_id)
            parent = h
        return hits, len(hits) * bs

    def max_hit_blocks(self, seq: Sequence, max_num_tokens: int | None = None) -> int:
        """The most full blocks a lookup of ``seq`` may hit (see ``get_computed_blocks``)."""
        limit = seq.num_tokens - 1 if max_num_tokens is None else min(seq.num_tokens - 1, max_num_tokens)
        return max(limit, 0) // self.block_size if self.enable_prefix_caching else 0

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup for the hit-rate statistics."""
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens
        self.prefix_cache_hit_blocks += num_hit_tokens // self.block_size

    def _register_pending(self, seq: Sequence, start: int, end: int) -> None:
        """Make the full blocks that this step's write of tokens ``start .. end`` completes
        findable by lookups in the same step (see the module docstring)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = max(len(seq.block_hashes), start // bs), end // bs
        if first >= last:
            return
        chain = self.block_hashes_of(seq, last)
        parent = chain[first - 1] if first else None
        for i in range(first, last):
            h = chain[i]
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._cached and h not in self._pending:
                block.block_hash, block.parent_hash = h, parent
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._pending[h] = block.block_id
            parent = h

    def begin_step(self) -> None:
        """Start planning a step: blocks still pending were not computed by the last step
        (it did not run to the end), so they stop being findable."""
        for block_id in list(self._pending.values()):
            self._uncache(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full, computed blocks in the prefix cache.

        Call after ``seq.num_computed_tokens`` advanced. Blocks already hashed are skipped; a
        pending block becomes cached; a block whose content is already cached under another
        block id stays private.
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = len(seq.block_hashes)
        if first >= num_full:
            return
        bs = self.block_size
        chain = self.block_hashes_of(seq, num_full)
        parent = chain[first - 1] if first else None
        for i in range(first, num_full):
            h = chain[i]
            block = self.blocks[seq.block_table[i]]
            if self.is_null(block.block_id):
                pass  # released behind a sliding window (the null block): nothing to cache
            elif self._pending.get(h) == block.block_id:
                del self._pending[h]
                self._cached[h] = block.block_id
            elif block.block_hash is None and h not in self._cached and h not in self._pending:
                block.block_hash, block.parent_hash = h, parent
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[h] = block.block_id
            seq.block_hashes.append(h)
            parent = h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no sequence holds (they become plain free blocks).

        Returns False, and changes nothing, while any block is in use (as vLLM's
        ``reset_prefix_cache``).
        """
        if self.num_used_blocks:
            return False
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            self._free.append(block_id)
        return True

    def is_null(self, block_id: int) -> bool:
        """A table entry released behind a sliding window (with no window, block 0 is a block
        like any other)."""
        return block_id == NULL_BLOCK and self.num_reserved > 0

    def _is_cached(self, block: Block) -> bool:
        """The block is the prefix cache's entry for its hash."""
        return block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self._is_cached(block):
            del self._cached[block.block_hash]
        elif block.block_hash is not None and self._pending.get(block.block_hash) == block_id:
            del self._pending[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None
