"""The CUDA kernels against the torch reference, on the CPU harness and (if present) a GPU.

On the CPU every case runs under two warp-by-warp schedules (ascending warps with shared memory
poisoned with NaN, descending warps with a huge finite poison); the two runs must agree bitwise,
since the kernels have no atomics and no schedule-dependent order of summation.
"""

from __future__ import annotations

import pytest
import torch
from kernel_runners import Runner, prebuild
from kernel_cases import (
    DecodeCase,
    assert_close_to_reference,
    make_decode_case,
    plant_late_maximum,
    reference_decode,
)

from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cuda.cuda_attention import HEAD_SIZES, PARTITION_SIZE, KernelOps

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, head_size, block_size, GQA group): every dtype, head size, block size, and group sizes
# 1 (MHA), 3 (SmolLM2), 4, 8 (the per-block maximum) and 12 (two head chunks per KV head).
VARIANTS = [
    (F32, 64, 16, 3),
    (F16, 128, 16, 4),
    (BF16, 128, 32, 8),
    (F16, 80, 8, 1),
    (BF16, 96, 16, 12),
    (F32, 256, 32, 2),
    (BF16, 256, 8, 4),
    (F16, 64, 32, 9),
]


# Every head size in float32 and float16 (block size 16), each run with GQA groups 1 to 8.
HEAD_VARIANTS = [(dt, hs, 16) for dt in (F32, F16) for hs in HEAD_SIZES]


@pytest.fixture(scope="module", autouse=True)
def _build_variants(request: pytest.FixtureRequest) -> None:
    # Compile the CPU modules up front, in parallel, unless only GPU cases were selected.
    if any("[cpu" in item.nodeid for item in request.session.items):
        prebuild([(dt, hs, bs) for dt, hs, bs, _ in VARIANTS] + HEAD_VARIANTS)


def run_all(runner: Runner, fn) -> list[tuple[str, object]]:
    return [(label, fn(ops)) for label, ops in runner.ops]


def check_decode(runner: Runner, case: DecodeCase, dtype: torch.dtype) -> torch.Tensor:
    """Runs ``case`` on every schedule of ``runner``; checks the reference and bitwise agreement."""
    ref = reference_decode(case)
    dev_case = case.to(runner.device)
    outs = run_all(runner, lambda ops: ops.paged_decode_attention(*dev_case.args(), **dev_case.options()))
    first_label, first = outs[0]
    for label, out in outs:
        assert out.dtype == dtype and out.shape == case.query.shape
        assert_close_to_reference(out, ref, dtype, f"{runner.name} {label}")
        assert torch.equal(out, first), f"{label} and {first_label} differ: schedule-dependent result"
    return first


@pytest.mark.parametrize("dtype,head_size,block_size,group", VARIANTS,
                         ids=[f"{str(d)[6:]}-h{h}-b{b}-g{g}" for d, h, b, g in VARIANTS])
def test_decode_ragged_partial_blocks(runner: Runner, dtype, head_size, block_size, group) -> None:
    bs = block_size
    # 1 token; partial, exact and just-over blocks; a tile boundary (64) and one past it.
    lens = [1, bs - 1, bs, bs + 1, 63, 64, 65, 3 * bs + 5]
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=bs, context_lens=lens,
                            group=group, seed=head_size + bs)
    check_decode(runner, case, dtype)


@pytest.mark.parametrize("dtype,head_size,block_size", [(F32, 64, 16), (BF16, 128, 32), (F16, 80, 8)])
def test_decode_split_k_long_contexts(runner: Runner, dtype, head_size, block_size) -> None:
    # Around the partition size, several partitions, and one long sequence alone (the case the
    # split exists for: few sequences, long context).
    p = PARTITION_SIZE
    check_decode(runner, make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                                          context_lens=[p, p + 1, 3 * p - 7, 1], group=3, seed=1),
                 dtype)
    check_decode(runner, make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                                          context_lens=[4096], num_kv_heads=1, group=4, seed=2),
                 dtype)


@pytest.mark.parametrize("dtype,head_size,block_size", HEAD_VARIANTS,
                         ids=[f"{str(d)[6:]}-h{h}" for d, h, _ in HEAD_VARIANTS])
def test_decode_every_head_size_and_group(runner: Runner, dtype, head_size, block_size) -> None:
    # GQA groups 1..8 (one block serves the whole group); a tile and a half, and a split-K
    # sequence, so the work split of every phase meets a partial tile at each head size.
    for group in range(1, 9):
        case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                                context_lens=[97, 1, PARTITION_SIZE + 33], num_kv_heads=2,
                                group=group, seed=100 * group + head_size)
        check_decode(runner, case, dtype)


@pytest.mark.parametrize("dtype,head_size,block_size", [(F32, 64, 16), (F16, 128, 16)])
def test_decode_more_than_32_partitions(runner: Runner, dtype, head_size, block_size) -> None:
    # 9,000+ tokens are 36 partitions: the reduce's per-partition loop then spans two warps, so
    # its cross-warp max and sum are in play. Sequence 0's largest logits lie in its last
    # partitions (past the first warp's 32), as do sequence 2's, with logits large enough that a
    # maximum taken over the first warp only overflows exp().
    lens = [9001, 300, 8480]
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                            context_lens=lens, num_kv_heads=2, group=4, seed=12)
    assert -(-lens[0] // PARTITION_SIZE) > 32
    plant_late_maximum(case, 0, 32 * PARTITION_SIZE)
    check_decode(runner, case, dtype)
    peaked = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                              context_lens=lens, num_kv_heads=1, group=2, seed=13)
    peaked.query *= 50
    plant_late_maximum(peaked, 0, 32 * PARTITION_SIZE)
    plant_late_maximum(peaked, 2, 33 * PARTITION_SIZE)
    check_decode(runner, peaked, dtype)


@pytest.mark.parametrize("dtype,head_size,block_size", [(F16, 128, 16), (F32, 64, 16)])
def test_decode_result_independent_of_batch(runner: Runner, dtype, head_size, block_size) -> None:
    # A short and a long sequence give bitwise the same output alone as next to a long sequence
    # (which turns the launch into a split-K one) and wider block tables.
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                            context_lens=[37, 700, 2000, 5], seed=3, extra_table_width=9)
    together = check_decode(runner, case, dtype)
    for row in (0, 1, 3):
        alone = case.select([row]).to(runner.device)
        for label, ops in runner.ops:
            out = ops.paged_decode_attention(*alone.args())
            assert torch.equal(out[0].cpu(), together[row].cpu()), f"{label}: sequence {row} changed"


@pytest.mark.parametrize("dtype,head_size,block_size", [(F16, 128, 16), (F32, 64, 16)])
def test_decode_large_logits_stay_finite(runner: Runner, dtype, head_size, block_size) -> None:
    # Logits of order 1000: exp() overflows float32 unless the running max is subtracted.
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                            context_lens=[90, 33, 400], group=4, seed=9)
    case.query *= 200
    check_decode(runner, case, dtype)


def test_decode_accepts_a_strided_query(runner: Runner) -> None:
    # The attention layer passes query[0].transpose(0, 1): a [tokens, heads, dim] view.
    case = make_decode_case(dtype=F16, head_size=128, block_size=16, context_lens=[20, 70], seed=10)
    strided = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    ref = reference_decode(case)
    dev = case.to(runner.device)
    for label, ops in runner.ops:
        out = ops.paged_decode_attention(strided.to(runner.device), *dev.args()[1:])
        assert_close_to_reference(out, ref, F16, label)


@pytest.mark.parametrize("dtype,head_size,block_size", [(BF16, 128, 32), (F16, 80, 8)])
def test_decode_cow_forked_block_tables(runner: Runner, dtype, head_size, block_size) -> None:
    # Four beams share their first blocks physically (a fork), then diverge in a private block.
    prefix = 3 * block_size
    lens = [prefix + 1, prefix + 2, prefix + block_size, prefix + 5]
    case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                            context_lens=lens, shared_prefix_blocks=3, seed=4)
    assert (case.block_tables[:, :3] == case.block_tables[0, :3]).all()
    check_decode(runner, case, dtype)


@pytest.mark.parametrize("schedule", ["round_robin", "random"])
def test_decode_other_schedules_agree(schedule: str) -> None:
    # Interleaving threads at every synchronisation point must not change a single bit.
    from kernel_runners import harness_ops

    case = make_decode_case(dtype=F16, head_size=128, block_size=16, context_lens=[70, 300, 9],
                            seed=5)
    base = harness_ops("warp", "nan").paged_decode_attention(*case.args())
    out = harness_ops(schedule, "nan").paged_decode_attention(*case.args())
    assert torch.equal(out, base)


@pytest.mark.parametrize("dtype,head_size,block_size", [(F32, 64, 16), (F16, 128, 16), (BF16, 96, 16)])
def test_reshape_and_cache_matches_reference(runner: Runner, dtype, head_size, block_size) -> None:
    gen = torch.Generator().manual_seed(6)
    kv_heads, num_blocks, num_tokens = 2, 12, 37
    shape = (num_blocks, block_size, kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # key and value as strided views of one fused projection, as attention layers produce them.
    fused = torch.randn(num_tokens, 3, kv_heads, head_size, generator=gen).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    for label, ops in runner.ops:
        got_k, got_v = k_cache.clone().to(runner.device), v_cache.clone().to(runner.device)
        ops.reshape_and_cache(key.to(runner.device), value.to(runner.device), got_k, got_v,
                              slots.to(runner.device))
        assert torch.equal(got_k.cpu(), want_k), label
        assert torch.equal(got_v.cpu(), want_v), label


def test_reshape_and_cache_converts_dtype_and_skips_padding(runner: Runner) -> None:
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.zeros(4, 16, 1, 64, dtype=F16)
    v_cache = torch.zeros(4, 16, 1, 64, dtype=F16)
    key = torch.randn(3, 1, 64, generator=gen)  # float32 into a float16 cache
    value = torch.randn(3, 1, 64, generator=gen)
    slots = torch.tensor([5, -1, 40])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key[[0, 2]], value[[0, 2]], want_k, want_v, slots[[0, 2]])
    for label, ops in runner.ops:
        got_k, got_v = k_cache.clone().to(runner.device), v_cache.clone().to(runner.device)
        ops.reshape_and_cache(key.to(runner.device), value.to(runner.device), got_k, got_v,
                              slots.to(runner.device))
        assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v), label


@pytest.mark.parametrize("dtype,block_size", [(F32, 8), (BF16, 32)])
def test_copy_blocks_matches_reference(runner: Runner, dtype, block_size) -> None:
    gen = torch.Generator().manual_seed(8)
    kv_cache = torch.randn(3, 2, 10, block_size, 2, 64, generator=gen).to(dtype)
    mapping = torch.tensor([[0, 7], [3, 8], [3, 9], [5, 1]])  # one source copied twice
    want = kv_cache.clone()
    reference.copy_blocks(want, mapping)
    for label, ops in runner.ops:
        got = kv_cache.clone().to(runner.device)
        ops.copy_blocks(got, mapping.to(runner.device))
        assert torch.equal(got.cpu(), want), label
        ops.copy_blocks(got, mapping[:0].to(runner.device))  # no pairs: nothing happens
        assert torch.equal(got.cpu(), want), label


@pytest.mark.parametrize("dtype,head_size,block_size", [(F32, 64, 16), (F16, 128, 8), (BF16, 96, 16)])
def test_decode_sliding_window_and_soft_cap(runner: Runner, dtype, head_size, block_size) -> None:
    # Windows ending inside a block (7, 20) and on a block edge (2 blocks), one longer than
    # some contexts, and one across the split-K partitions (300 of 700 keys: partitions start
    # at the window's first key); each alone and with a soft cap (Gemma 2's 50 is too loose to
    # matter at these logits; 2.0 flattens them).
    lens = [1, 5, 2 * block_size + 3, 65, 700]
    for window in (7, 2 * block_size, 20, 300):
        for cap in (None, 2.0):
            case = make_decode_case(dtype=dtype, head_size=head_size, block_size=block_size,
                                    context_lens=lens, group=3, seed=window)
            case.sliding_window, case.logits_soft_cap = window, cap
            windowed = check_decode(runner, case, dtype)
            case.sliding_window = case.logits_soft_cap = None
            assert not torch.allclose(windowed.cpu().float(), reference_decode(case)), "window had no effect"


def test_prefill_is_the_sdpa_reference() -> None:
    # The documented choice: prefill on the cuda backend is the torch reference (after the
    # index checks), bit for bit.
    from cuda_harness.backend import HarnessBackend

    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, 16, 2, 64, generator=gen), torch.randn(4, 16, 2, 64, generator=gen)
    q = torch.randn(6, 4, 64, generator=gen)
    args = (q, k, v, torch.tensor([[3, 1], [0, 2]], dtype=torch.int32),
            torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([20, 2], dtype=torch.int32), 0.125)
    ops = KernelOps(HarnessBackend())
    assert torch.equal(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))
