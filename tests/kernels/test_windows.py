"""Sliding windows and attention logit soft-capping in the paged attention.

The torch reference is held to a float64 oracle written from the definitions (HF's: a token at
position ``p`` of a window ``W`` sees ``p - W + 1 .. p``; a soft cap ``c`` turns each scaled logit
``x`` into ``tanh(x / c) * c`` before the softmax); the C kernel is held to the reference in every
dtype, in decode and in prefill chunks, with windows ending inside a block, on a block's edge,
longer than the context, and a block size of 1; and its windowed rows stay bit-identical
whether computed by a decode, a whole prefill or any chunking, and never read the blocks before
the window. (The CUDA kernel's windows: tests/kernels/test_kernels.py and test_mutations.py on
the CPU harness; AVX2 and plain C builds: test_avx2_parity.py.)
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close_to_reference, make_decode_case

from batchgen.kernels import cpu as kcpu
from batchgen.kernels import get_ops
from batchgen.kernels import torch_attention as reference

LENS = [1, 5, 16, 17, 40, 90]
Q_LENS = [1, 5, 9, 1, 23, 90]  # whole prompts, chunks over a cached prefix, one-token chunks


def _prefill_query(case, q_lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(int(starts[-1]), *case.query.shape[1:], generator=gen).to(case.query.dtype)
    return query, starts


def _oracle(query: torch.Tensor, case, starts: torch.Tensor | None, window: int | None,
            cap: float | None) -> torch.Tensor:
    """Each query row from the definitions, in float64, one key at a time off the block table."""
    block_size, kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, ctx in enumerate(case.context_lens.tolist()):
        q0, q1 = (s, s + 1) if starts is None else (int(starts[s]), int(starts[s + 1]))
        for row in range(q0, q1):
            pos = ctx - (q1 - q0) + (row - q0)
            first = max(0, pos - window + 1) if window else 0
            keys = range(first, pos + 1)
            slots = [(int(case.block_tables[s, p // block_size]), p % block_size) for p in keys]
            k = torch.stack([case.k_cache[b, o] for b, o in slots]).double()  # [n, KVH, D]
            v = torch.stack([case.v_cache[b, o] for b, o in slots]).double()
            for h in range(query.shape[1]):
                x = (k[:, h // group] @ query[row, h].double()) * case.scale
                if cap:
                    x = torch.tanh(x / cap) * cap
                out[row, h] = torch.softmax(x, 0) @ v[:, h // group]
    return out.float()


@pytest.mark.parametrize("block_size,window,cap", [
    (16, 16, None),   # a window of one block: windows end inside blocks
    (5, 7, 2.0),      # windows ending inside blocks, soft-capped
    (1, 9, None),     # one token per block
    (16, None, 1.5),  # soft cap alone
    (4, 300, 3.0),    # a window longer than every context: full attention
])
def test_the_reference_is_the_definition(block_size: int, window: int | None, cap: float | None) -> None:
    case = make_decode_case(dtype=torch.float32, head_size=16, block_size=block_size, context_lens=LENS,
                            num_kv_heads=2, group=2, seed=block_size)
    options = {"sliding_window": window, "logits_soft_cap": cap}
    got = reference.paged_decode_attention(*case.args(), **options)
    torch.testing.assert_close(got, _oracle(case.query, case, None, window, cap), atol=2e-6, rtol=2e-6)
    query, starts = _prefill_query(case, Q_LENS, seed=1)
    got = reference.paged_prefill_attention(query, case.k_cache, case.v_cache, case.block_tables, starts,
                                            case.context_lens, case.scale, **options)
    torch.testing.assert_close(got, _oracle(query, case, starts, window, cap), atol=2e-6, rtol=2e-6)


cpu_only = pytest.mark.skipif(kcpu.compiler() is None, reason="no C compiler (cc/gcc) on this machine")


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,group,block_size,window,cap", [
    (64, 3, 16, 16, None),
    (64, 3, 16, 20, 2.0),
    (32, 2, 1, 7, None),
    (80, 8, 5, 9, 1.0),
    (64, 1, 16, None, 2.5),
])
def test_the_cpu_kernel_matches_the_reference(dtype, head_size, group, block_size, window, cap) -> None:
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size, context_lens=LENS,
                            num_kv_heads=2, group=group, seed=head_size + block_size)
    ops = get_ops("cpu")
    options = {"sliding_window": window, "logits_soft_cap": cap}
    f = {"k_cache": case.k_cache.float(), "v_cache": case.v_cache.float()}
    out = ops.paged_decode_attention(*case.args(), **options)
    ref = reference.paged_decode_attention(case.query.float(), f["k_cache"], f["v_cache"], case.block_tables,
                                           case.context_lens, case.scale, **options)
    assert_close_to_reference(out, ref, dtype, f"decode {window} {cap}")
    query, starts = _prefill_query(case, Q_LENS, seed=2)
    out = ops.paged_prefill_attention(query, case.k_cache, case.v_cache, case.block_tables, starts,
                                      case.context_lens, case.scale, **options)
    ref = reference.paged_prefill_attention(query.float(), f["k_cache"], f["v_cache"], case.block_tables, starts,
                                            case.context_lens, case.scale, **options)
    assert_close_to_reference(out, ref, dtype, f"prefill {window} {cap}")


@cpu_only
@pytest.mark.parametrize("block_size,window", [(16, 16), (5, 7), (1, 11)])
def test_a_windowed_token_is_bit_identical_however_it_is_computed(block_size: int, window: int) -> None:
    """One 70-token sequence: its rows from one whole prefill, from chunks of 1, 4, 13 and 29
    tokens (each over the cached rest), and from a decode at every position agree bit for bit."""
    n = 70
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=block_size, context_lens=[n],
                            num_kv_heads=2, group=3, seed=block_size)
    ops = get_ops("cpu")
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(n, *case.query.shape[1:], generator=gen)
    options = {"sliding_window": window, "logits_soft_cap": 2.0}

    def chunk(lo: int, hi: int) -> torch.Tensor:
        return ops.paged_prefill_attention(query[lo:hi], case.k_cache, case.v_cache, case.block_tables,
                                           torch.tensor([0, hi - lo], dtype=torch.int32),
                                           torch.tensor([hi], dtype=torch.int32), case.scale, **options)

    whole = chunk(0, n)
    for size in (1, 4, 13, 29):
        parts = torch.cat([chunk(lo, min(lo + size, n)) for lo in range(0, n, size)])
        assert torch.equal(parts, whole), f"chunks of {size}"
    decodes = torch.cat([ops.paged_decode_attention(query[p:p + 1], case.k_cache, case.v_cache, case.block_tables,
                                                    torch.tensor([p + 1], dtype=torch.int32), case.scale,
                                                    **options) for p in range(n)])
    assert torch.equal(decodes, whole)


@cpu_only
def test_blocks_before_every_window_are_not_read() -> None:
    """With a window, a sequence's blocks wholly before the first key any of its rows sees may
    hold any id (here -1, which would fault if read): the output is the same."""
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=4, context_lens=[40, 13],
                            num_kv_heads=2, group=3, seed=4)
    ops = get_ops("cpu")
    options = {"sliding_window": 10}
    want = ops.paged_decode_attention(*case.args(), **options)
    holes = case.block_tables.clone()
    holes[0, :7] = -1  # keys 0 .. 27; the decode at 39 sees 30 .. 39
    holes[1, :1] = -1  # keys 0 .. 3; the decode at 12 sees 3 .. 12: block 0 is read
    with pytest.raises(ValueError, match="block table entries"):
        ops.paged_decode_attention(case.query, case.k_cache, case.v_cache, holes, case.context_lens,
                                   case.scale, **options)
    holes[1, 0] = case.block_tables[1, 0]
    got = ops.paged_decode_attention(case.query, case.k_cache, case.v_cache, holes, case.context_lens,
                                     case.scale, **options)
    assert torch.equal(got, want)


@cpu_only
def test_bad_options_are_refused() -> None:
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=4, context_lens=[5],
                            num_kv_heads=1, group=1, seed=5)
    ops = get_ops("cpu")
    for options in ({"sliding_window": -3}, {"logits_soft_cap": float("nan")}, {"logits_soft_cap": -1.0}):
        with pytest.raises(ValueError, match="sliding_window must be >= 0"):
            ops.paged_decode_attention(*case.args(), **options)
