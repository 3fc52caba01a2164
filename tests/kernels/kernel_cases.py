"""Random paged-attention problems for the kernel tests, built on the CPU from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tolerances of a kernel output (in its dtype) against the float32 reference on the same inputs:
# about two units in the last place of the output dtype, plus float32 summation-order noise.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class DecodeCase:
    """Inputs of ``paged_decode_attention`` (CPU tensors)."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def to(self, device: torch.device) -> DecodeCase:
        return DecodeCase(self.query.to(device), self.k_cache.to(device), self.v_cache.to(device),
                          self.block_tables.to(device), self.context_lens.to(device), self.scale,
                          self.sliding_window, self.logits_soft_cap)

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.scale)

    def options(self) -> dict:
        """The layer options, as keywords of the decode op."""
        return {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap}

    def select(self, rows: list[int]) -> DecodeCase:
        """The same problem restricted to some sequences (same cache, same tables)."""
        idx = torch.tensor(rows)
        lens = self.context_lens[idx]
        block_size = self.k_cache.shape[1]
        width = max(1, -(-int(lens.max()) // block_size))
        return DecodeCase(self.query[idx].contiguous(), self.k_cache, self.v_cache,
                          self.block_tables[idx, :width].contiguous(), lens.contiguous(), self.scale,
                          self.sliding_window, self.logits_soft_cap)


def make_decode_case(
    *,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    context_lens: list[int],
    num_kv_heads: int = 2,
    group: int = 4,
    seed: int = 0,
    shared_prefix_blocks: int = 0,
    extra_table_width: int = 1,
) -> DecodeCase:
    """A batch of sequences over a shuffled block pool.

    Each sequence gets distinct physical blocks in random order, except that with
    ``shared_prefix_blocks`` > 0 every sequence maps its first blocks to the *same* physical
    blocks, as after a copy-on-write fork. Table entries past a sequence's last block hold random
    (valid) block ids that the kernel must never use; ``extra_table_width`` adds such columns
    beyond the longest sequence.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    width = max(blocks_per_seq) + extra_table_width
    shared = shared_prefix_blocks
    own = sum(max(0, b - shared) for b in blocks_per_seq)
    num_blocks = shared + own + 3
    perm = torch.randperm(num_blocks, generator=gen)
    prefix, rest = perm[:shared], perm[shared:]
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen, dtype=torch.int32)
    cursor = 0
    for s, nb in enumerate(blocks_per_seq):
        k = min(shared, nb)
        tables[s, :k] = prefix[:k].to(torch.int32)
        n_own = nb - k
        tables[s, k:nb] = rest[cursor : cursor + n_own].to(torch.int32)
        cursor += n_own
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(context_lens), num_kv_heads * group, head_size, generator=gen).to(dtype)
    # Scale above the usual 1/sqrt(d) so the softmax is peaked and the max-subtraction matters.
    return DecodeCase(query, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32),
                      2.0 * head_size**-0.5)


def plant_late_maximum(case: DecodeCase, seq: int, start: int, factor: float = 2.0) -> None:
    """Scale the K rows of sequence ``seq`` from position ``start`` on by ``factor`` (in place).

    Every query head's largest logits then lie past ``start``: with ``start`` beyond the first 32
    partitions, the split-K reduce must take its maximum and its sum across warps to be right.
    The sequence's blocks must be its own (no shared prefix).
    """
    block_size = case.k_cache.shape[1]
    n = int(case.context_lens[seq])
    kv = case.k_cache.float()
    for pos in range(start, n):
        block = int(case.block_tables[seq, pos // block_size])
        kv[block, pos % block_size] *= factor
    case.k_cache.copy_(kv.to(case.k_cache.dtype))


def reference_decode(case: DecodeCase) -> torch.Tensor:
    """The torch reference in float32 on the (already rounded) inputs, on the CPU."""
    from batchgen.kernels import torch_attention as reference

    c = case.to(torch.device("cpu"))
    return reference.paged_decode_attention(c.query.float(), c.k_cache.float(), c.v_cache.float(),
                                            c.block_tables, c.context_lens, c.scale, **c.options())


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, label: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    out = out.detach().cpu().float()
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
