"""The fused CPU ops (``kernels/cpu/fused.c``): RMSNorm (alone and after a residual add),
act·up (SiLU and GELU-tanh), RoPE with the cache write, the greedy pick, the prompt logprobs' logsumexp and rank.

Each op is checked against its torch reference (``kernels/cpu/reference.py``, the torch ops it
replaces), in float32 and, for RMSNorm and act·up, bfloat16 and float16, including the edges
of its ``exp`` (overflow, underflow, NaN) and argmax ties across vector lanes; rows are
bit-identical at any thread count and alone or in a batch. The layers built on them and the
model's fusion are the engine's (tests/engine/test_fusion.py, test_fused_attention.py). A
machine where the library cannot be built skips with that reason.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import cpu_reference as reference
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.sampling.params import SamplingParams
from batchgen.sampling.sampler import Sampler, SamplingRow

needs_lib = pytest.mark.skipif(not cpu_fused.available(), reason="the fused CPU ops cannot be built here")


_torch_rms_norm = reference.rms_norm
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    """Equal, or one unit in the last place apart (a float32 sum in another order can land a
    value on the other side of a 16-bit rounding boundary), or ``ulps``; mostly equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    ulp = ulps * ULP[got.dtype] * w.abs().clamp_min(torch.finfo(got.dtype).tiny)
    assert bool(((g - w).abs() <= ulp).all()), f"max diff {(g - w).abs().max():.3e}"
    assert (got == want).float().mean() >= 0.99


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 8, 17, 576])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_16_bit_rms_norm_and_gated_mul_round_as_torch_does(dtype, width, activation) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(13, width, generator=gen) * 3).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    _assert_within_one_ulp(cpu_fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    gu = (torch.randn(13, 2 * width, generator=gen) * 4).to(dtype)
    got, want = cpu_fused.gated_mul(gu, activation), reference.gated_mul(gu, activation)
    # torch's GELU-tanh loses 1 + tanh(z) to cancellation below g = -3 (0 below about -5); the
    # kernel's g sigmoid(2z) keeps it: there the two differ by torch's error, not by one ulp
    clean = gu[:, :width] > -3.0 if activation == "gelu_tanh" else torch.ones_like(got, dtype=torch.bool)
    # an activation one ulp off (its float32 value an ulp from a 16-bit tie), times u, rounds
    # up to two ulps off
    _assert_within_one_ulp(got[clean], want[clean], ulps=2)
    diff, u = (got.float() - want.float()).abs(), gu[:, width:].float().abs()
    assert bool((diff <= ULP[dtype] * want.float().abs() + 1e-6 * u)[~clean].all())
    special = torch.tensor([[float("inf"), float("-inf"), float("nan"), 5.0, 1.0, 1.0, 1.0, float("nan")]]).to(dtype)
    got, want = cpu_fused.gated_mul(special, activation)[0], reference.gated_mul(special, activation)[0]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bit_identical_at_any_thread_count(kernel_threads, dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(70, 600, generator=gen) * 2).to(dtype)
    weight = torch.randn(600, generator=gen).to(dtype)
    gu = torch.randn(70, 1200, generator=gen).to(dtype)
    logits = torch.randn(40, 3000, generator=gen)
    kernel_threads(1)
    want = cpu_fused.rms_norm(x, weight, 1e-6), cpu_fused.gated_mul(gu), cpu_fused.greedy(logits)
    for n in (2, 3):
        kernel_threads(n)
        got = cpu_fused.rms_norm(x, weight, 1e-6), cpu_fused.gated_mul(gu), cpu_fused.greedy(logits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
        assert torch.equal(cpu_fused.rms_norm(x[33:34], weight, 1e-6)[0], want[0][33])
        assert torch.equal(cpu_fused.gated_mul(gu[69:])[0], want[1][69])


@needs_lib
@pytest.mark.parametrize("width", [1, 15, 16, 17, 64, 576])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_rms_norm_matches_torch(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    got = cpu_fused.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, _torch_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=1e-6)


@needs_lib
def test_rms_norm_strided_batched_and_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 9, 100, generator=gen)
    x = wide[..., 10:74]  # rows with a stride of 100
    weight = torch.randn(64, generator=gen)
    got = cpu_fused.rms_norm(x, weight, 1e-6)
    assert got.shape == (2, 9, 64)
    torch.testing.assert_close(got, _torch_rms_norm(x, weight, 1e-6), rtol=2e-6, atol=1e-6)
    alone = cpu_fused.rms_norm(x[1, 4:5], weight, 1e-6)
    assert torch.equal(alone[0], got[1, 4])


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 8, 17, 576])
def test_a_float32_weight_scales_16_bit_rows_before_their_one_rounding(dtype, width) -> None:
    """Gemma's norm on 16-bit rows: ``(x * inv) * (1 + w)`` in float32, rounded once (a float32
    weight: fused.c's W_F32), within a rounding of HF's; not what a 16-bit weight gives, where
    the row is rounded before the product; and after a residual add too."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(13, width, generator=gen) * 3).to(dtype)
    weight = torch.empty(width).uniform_(-0.9, 0.9, generator=gen).to(dtype)
    one_plus = 1.0 + weight.float()
    got = cpu_fused.rms_norm(x, one_plus, 1e-6)
    _assert_within_one_ulp(got, reference.gemma_rms_norm(x, weight, 1e-6))
    if width >= 17:  # enough values that some land on the other side of a rounding
        assert not torch.equal(got, cpu_fused.rms_norm(x, one_plus.to(dtype), 1e-6))
    h = (torch.randn(13, width, generator=gen) * 3).to(dtype)
    total, normed = cpu_fused.add_rms_norm(x, h, one_plus, 1e-6)
    assert torch.equal(total, x + h) and torch.equal(normed, cpu_fused.rms_norm(x + h, one_plus, 1e-6))


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 17, 576, 2048])
def test_add_rms_norm_is_torchs_add_then_the_fused_norm_bit_for_bit(dtype, width) -> None:
    """A decoder layer's residual add and second norm in one pass: the sum is torch's ``x + h``
    and the norm rms_norm's of that sum, bit for bit; strided rows and rows alone give the same."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 9, width + 5, generator=gen) * 3).to(dtype)[..., 5:]  # strided rows
    h = (torch.randn(2, 9, width, generator=gen) * 3).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    total, normed = cpu_fused.add_rms_norm(x, h, weight, 1e-5)
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    assert torch.equal(total, x + h)
    assert torch.equal(normed, cpu_fused.rms_norm(x + h, weight, 1e-5))
    alone = cpu_fused.add_rms_norm(x[1, 4:5], h[1, 4:5], weight, 1e-5)
    assert torch.equal(alone[0][0], total[1, 4]) and torch.equal(alone[1][0], normed[1, 4])


@needs_lib
def test_add_rms_norm_contract_violations_raise() -> None:
    with pytest.raises(ValueError, match="one shape and dtype"):
        cpu_fused.add_rms_norm(torch.zeros(2, 4), torch.zeros(1, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="one shape and dtype"):
        cpu_fused.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="1-D torch.float32 weight"):
        cpu_fused.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 2), 1e-6)
    with pytest.raises(ValueError, match=r"float32 CPU input \[\.\.\., 4\]"):
        cpu_fused.add_rms_norm(torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(4), 1e-6)


#: Each activation as ``g sigmoid(a(g))``: its argument ``a``, for an exact float64 reference
#: that does not cancel (torch's ``0.5 g (1 + tanh z)`` loses ``1 + tanh z`` for negative ``g``,
#: in float64 too, from about g = -10).
SIGMOID_ARG = {"silu": lambda g: g, "gelu_tanh": lambda g: 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)}


@needs_lib
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mul_matches_torch_including_the_edges_of_exp(activation) -> None:
    g = torch.cat([torch.linspace(-110, 110, 20001),
                   torch.tensor([-88.73, -88.72, -88.5, -87.4, -87.3, 87.4, 88.5, 88.8, 0.0, -0.0, 1e13, -1e13])])
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(g.shape, generator=gen)
    got = cpu_fused.gated_mul(torch.cat([g, u])[None], activation)[0]
    g64, u64 = g.double(), u.double()
    arg = SIGMOID_ARG[activation](g64)
    exact = g64 * torch.sigmoid(arg) * u64
    # float32's own conditioning: exp of an argument |a| rounded to float32 is off by |a| eps;
    # and below 1e-36 |u| (exp past float32's range) a result may be 0, as in torch's float32
    bound = (4e-7 + 2.4e-7 * arg.abs().clamp_max(1e30)) * exact.abs() + 1e-36 * u64.abs() + 1e-37
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {(err / bound).max():.3f} of the bound"
    if activation == "silu":  # and torch's float32 silu, where nothing cancels
        want = reference.gated_mul(torch.cat([g, u])[None], activation)[0]
        assert bool(((got - want).abs() <= 4e-7 * want.abs() + 1e-37).all())
    special = torch.tensor([[float("inf"), float("-inf"), float("nan"), 5.0, 1.0, 1.0, 1.0, float("nan")]])
    got = cpu_fused.gated_mul(special, activation)[0]
    want = reference.ACTIVATIONS[activation](special[0, :4]) * special[0, 4:]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@needs_lib
def test_gated_mul_rows_and_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 5, 2 * 48, generator=gen)
    got = cpu_fused.gated_mul(gu)
    assert got.shape == (3, 5, 48)
    torch.testing.assert_close(got, F.silu(gu[..., :48]) * gu[..., 48:], rtol=4e-7, atol=1e-7)
    assert torch.equal(cpu_fused.gated_mul(gu[2, 1:2])[0], got[2, 1])
    assert cpu_fused.gated_mul(torch.empty(0, 8)).shape == (0, 4)


@needs_lib
def test_contract_violations_raise() -> None:
    with pytest.raises(ValueError, match="even last dim"):
        cpu_fused.gated_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        cpu_fused.gated_mul(torch.zeros(2, 8), "gelu")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 CPU input"):
        cpu_fused.gated_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"float32 CPU input \[\.\.\., 4\]"):
        cpu_fused.rms_norm(torch.zeros(2, 5), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="1-D torch.float32 weight"):
        cpu_fused.rms_norm(torch.zeros(2, 4), torch.ones(4, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match=r"1-D torch.bfloat16 \(or float32\) weight"):  # its own dtype or float32
        cpu_fused.rms_norm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="inference only"):
        cpu_fused.rms_norm(torch.zeros(2, 4, requires_grad=True), torch.ones(4), 1e-6)


@needs_lib
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152])
def test_greedy_equals_argmax_and_log_softmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 4
    ids, logprobs = cpu_fused.greedy(logits)
    want_ids, exact = reference.greedy(logits)
    assert ids == want_ids
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64), rtol=0, atol=1e-6)


@needs_lib
def test_greedy_ties_take_the_first_index_across_lanes_and_tail() -> None:
    logits = torch.zeros(4, 40)
    logits[0, [20, 7, 33]] = 9.0   # in lanes 4 and 7 and in the tail: index 7 comes first
    logits[1, [19, 3]] = 9.0       # twice in lane 3: the earlier block wins
    logits[2, [35, 36]] = 9.0      # both in the tail (past the last whole block of 16)
    logits[3, :] = -1.0            # every entry tied
    ids, _ = cpu_fused.greedy(logits)
    assert ids == torch.argmax(logits, dim=-1).tolist() == [7, 3, 35, 0]


@needs_lib
def test_greedy_leaves_nan_inf_and_other_dtypes_to_torch() -> None:
    row = torch.randn(1, 64)
    for bad in (float("nan"), float("inf")):
        logits = row.clone()
        logits[0, 5] = bad
        assert cpu_fused.greedy(logits) is None
    # an all -inf row: torch's path runs, so that the sampler's own error speaks
    assert cpu_fused.greedy(torch.full((1, 64), float("-inf"))) is None
    assert cpu_fused.greedy(row.double()) is None
    assert cpu_fused.greedy(row.to(torch.bfloat16)) is None


@needs_lib
def test_sampler_fused_greedy_picks_what_torch_picks() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen) * 3

    def rows(**kw):
        return [SamplingRow(params=SamplingParams(temperature=0.0, **kw), prompt_token_ids=[1],
                            output_token_ids=[], generator=None) for _ in range(6)]
    plain = Sampler()(logits, rows())
    fused = Sampler(fused_greedy=True)(logits, rows())
    assert fused.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(plain.logprobs), rtol=0, atol=4e-6)
    asked = Sampler(fused_greedy=True)(logits, rows(logprobs=2))  # top logprobs: torch's path
    assert asked.top_logprobs[0] is not None and len(asked.top_logprobs[0]) == 2


@needs_lib
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152])
def test_token_logprobs_equal_logsumexp_and_rank(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 4
    logits[3, :] = 0.5  # every entry tied with the target: rank 1
    targets = torch.randint(0, vocab, (9,), generator=gen)
    lse, ranks = cpu_fused.token_logprobs(logits, targets)
    assert torch.equal(lse, cpu_fused.logsumexp(logits))  # the sampler's logsumexp, bit for bit
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), dim=-1), rtol=0, atol=2e-6)
    target = logits.gather(1, targets.unsqueeze(1))
    assert ranks.tolist() == ((logits > target).sum(-1) + 1).tolist()
    assert ranks[3] == 1


@needs_lib
def test_token_logprobs_rows_alone_at_any_thread_count_and_edges(kernel_threads) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(40, 3000, generator=gen) * 3
    targets = torch.randint(0, 3000, (40,), generator=gen)
    kernel_threads(1)
    want = cpu_fused.token_logprobs(logits, targets)
    for n in (2, 3):
        kernel_threads(n)
        got = cpu_fused.token_logprobs(logits, targets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        alone = cpu_fused.token_logprobs(logits[17:18], targets[17:18])
        assert torch.equal(alone[0], want[0][17:18]) and torch.equal(alone[1], want[1][17:18])
    strided = cpu_fused.token_logprobs(logits[::2], targets[::2])
    assert torch.equal(strided[0], want[0][::2]) and torch.equal(strided[1], want[1][::2])
    bad = logits[:3].clone()
    bad[0, 5], bad[1, 6] = float("nan"), float("inf")
    lse, ranks = cpu_fused.token_logprobs(bad, torch.tensor([4, 6, 7]))
    assert lse[0].isnan() and lse[1] == float("inf") and torch.equal(lse[2], want[0][2])
    assert ranks[1] == 1  # the target is the +inf entry
    assert cpu_fused.token_logprobs(logits.double(), targets) is None
    with pytest.raises(ValueError, match="ids in"):
        cpu_fused.token_logprobs(logits, targets + 3000)


def _rope_case(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_size: int, seed: int = 0):
    """A fused q/k/v output, HF-style cos/sin at random positions, a random paged cache and
    distinct random slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = positions[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]  # [1, T, D], as HF hands them
    cache = torch.randn(2, 9, 4, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(9 * 4, generator=gen)[:tokens]
    return qkv, cos, sin, cache, slots


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_size", [
    (1, 1, 1, 2), (7, 9, 3, 64), (31, 4, 2, 36), (5, 8, 1, 128), (3, 2, 2, 80)])
def test_rope_and_cache_equals_hf_rope_and_reshape_and_cache_bitwise(dtype, tokens, heads, kv_heads, head_size) -> None:
    """The C pass gives the bits of HF's ``apply_rotary_pos_emb`` (mul, mul, add; in 16-bit
    each rounded) and of the engine's ``reshape_and_cache``: odd token counts, GQA and MHA,
    half head sizes that are and are not a multiple of the 8-lane vectors."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from batchgen.kernels import torch_attention as attention_reference

    qkv, cos, sin, cache, slots = _rope_case(dtype, tokens, heads, kv_heads, head_size, seed=tokens + head_size)
    q_end, k_end = heads * head_size, (heads + kv_heads) * head_size
    q = qkv[:, :q_end].view(1, tokens, heads, head_size).transpose(1, 2)
    k = qkv[:, q_end:k_end].view(1, tokens, kv_heads, head_size).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    want_cache = cache.clone()
    attention_reference.reshape_and_cache(want_k[0].transpose(0, 1), qkv[:, k_end:].view(tokens, kv_heads, head_size),
                                          want_cache[0], want_cache[1], slots)

    got = qkv.clone()
    got_cache = cache.clone()
    cpu_fused.rope_and_cache(got, cos, sin, got_cache[0], got_cache[1], slots, heads)
    assert torch.equal(got[:, :q_end].view(tokens, heads, head_size), want_q[0].transpose(0, 1))
    assert torch.equal(got[:, q_end:k_end].view(tokens, kv_heads, head_size), want_k[0].transpose(0, 1))
    assert torch.equal(got[:, k_end:], qkv[:, k_end:])  # the value heads are not touched
    assert torch.equal(got_cache, want_cache)

    ref, ref_cache = qkv.clone(), cache.clone()
    reference.rope_and_cache(ref, cos, sin, ref_cache[0], ref_cache[1], slots, heads)
    assert torch.equal(got, ref) and torch.equal(got_cache, ref_cache)


@needs_lib
def test_rope_and_cache_rows_are_bit_identical_at_any_thread_count_and_in_a_3d_batch(kernel_threads) -> None:
    qkv, cos, sin, cache, slots = _rope_case(torch.bfloat16, 33, 9, 3, 64)
    kernel_threads(1)
    want, want_cache = qkv.clone(), cache.clone()
    cpu_fused.rope_and_cache(want, cos, sin, want_cache[0], want_cache[1], slots, 9)
    for n in (2, 3):
        kernel_threads(n)
        got, got_cache = qkv.clone()[None], cache.clone()  # [1, T, width], as the model hands it
        cpu_fused.rope_and_cache(got, cos, sin, got_cache[0], got_cache[1], slots, 9)
        assert torch.equal(got[0], want) and torch.equal(got_cache, want_cache)
    one, one_cache = qkv[20:21].clone(), cache.clone()
    cpu_fused.rope_and_cache(one, cos[:, 20:21], sin[:, 20:21], one_cache[0], one_cache[1], slots[20:21], 9)
    assert torch.equal(one[0], want[20])


@needs_lib
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,head_size", [(7, 64), (3, 20)])
def test_rope_and_cache_writes_float32_rows_into_a_16_bit_cache_as_to_rounds(kv_dtype, tokens, head_size) -> None:
    """``kv_cache_dtype``: a float32 model's rotated key heads and its value heads land in a
    bfloat16 or float16 cache rounded as torch's ``.to()`` rounds them (nearest even; a NaN
    stays a NaN; a row whose length is not a multiple of the 8-lane vectors too); the rows
    themselves are rotated in float32 as with a float32 cache."""
    if not cpu_fused.supported(kv_dtype):
        pytest.skip(f"this build lacks the {kv_dtype} conversions (AVX2 and F16C)")
    qkv, cos, sin, cache32, slots = _rope_case(torch.float32, tokens, 3, 1, head_size, seed=tokens)
    qkv[0, 3 * head_size] = float("nan")  # a key value
    qkv[1, 4 * head_size + 1] = 1e6  # a value past float16's range: inf, as .to() gives
    want, want_cache = qkv.clone(), cache32.clone()
    cpu_fused.rope_and_cache(want, cos, sin, want_cache[0], want_cache[1], slots, 3)
    got, got_cache = qkv.clone(), cache32.to(kv_dtype)
    cpu_fused.rope_and_cache(got, cos, sin, got_cache[0], got_cache[1], slots, 3)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: a NaN is no equal of itself
    # every value's bits as .to() rounds it; a NaN a NaN (its sign and payload are not kept)
    torch.testing.assert_close(got_cache, want_cache.to(kv_dtype), rtol=0, atol=0, equal_nan=True)
    assert got_cache.isnan().any() and got_cache.isinf().any() == (kv_dtype is torch.float16)


@needs_lib
def test_rope_and_cache_contract_violations_raise_and_write_nothing() -> None:
    qkv, cos, sin, cache, slots = _rope_case(torch.float32, 4, 4, 2, 16)
    before, before_cache = qkv.clone(), cache.clone()
    bad = slots.clone()
    bad[3] = 9 * 4  # one past the last slot
    with pytest.raises(ValueError, match="slots must lie in"):
        cpu_fused.rope_and_cache(qkv, cos, sin, cache[0], cache[1], bad, 4)
    with pytest.raises(ValueError, match="slots must lie in"):
        cpu_fused.rope_and_cache(qkv, cos, sin, cache[0], cache[1], -1 - slots, 4)
    assert torch.equal(qkv, before) and torch.equal(cache, before_cache)
    with pytest.raises(ValueError, match="qkv must be"):
        cpu_fused.rope_and_cache(qkv, cos, sin, cache[0], cache[1], slots, 3)  # heads do not fit
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_fused.rope_and_cache(qkv, cos[:, :3], sin[:, :3], cache[0], cache[1], slots, 4)
    with pytest.raises(ValueError, match="rope_and_cache"):  # partial rotary: cos narrower than the head
        cpu_fused.rope_and_cache(qkv, cos[..., :8], sin[..., :8], cache[0], cache[1], slots, 4)
    with pytest.raises(ValueError, match="caches must be"):
        cpu_fused.rope_and_cache(qkv, cos, sin, cache[0].double(), cache[1].double(), slots, 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_fused.rope_and_cache(qkv, cos, sin, cache[0], cache[1], slots.int(), 4)
    assert torch.equal(qkv, before) and torch.equal(cache, before_cache)
