"""AVX2 parity: the attention kernel's AVX2 variant (16 keys' scores as two transposed trees of 8,
a vector exp and softmax, P·V accumulators in registers, vector bfloat16 / float16 conversions)
gives the same bits as its AVX-512 and plain-C variants, in decode and prefill, for every dtype
and a spread of head sizes and GQA groups; and each forced build runs the variant asked for.

The builds are forced as the quantized kernel's are (``quant.py``'s ``ISAS``): the same source
through ``c_build.load_library`` with ``-mno-avx512f`` (what an AVX2 + FMA CPU such as an AMD EPYC
runs) or ``-mno-avx2`` (plain C) added to ``-march=native``. Each build reports its variant
(``batchgen_attention_isa``), so a test cannot pass by comparing a build with itself. The
oracle for all three is the torch reference (``torch_attention``), within float32 rounding.
``BATCHGEN_CPU_ISA=avx2`` (``c_build.CPU_ISA_CAPS``) builds every kernel of a process so.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import assert_close_to_reference, make_decode_case

from batchgen.kernels import cpu as kcpu
from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cpu import c_build, cpu_attention

pytestmark = [
    pytest.mark.skipif(kcpu.compiler() is None, reason="no C compiler (cc/gcc) on this machine"),
    pytest.mark.skipif(c_build.missing_cpu_features("avx2", "fma", "f16c") is not None,
                       reason=str(c_build.missing_cpu_features("avx2", "fma", "f16c"))),
]

# the extra flags of each forced build, and the variant it must report (2 AVX-512, 1 AVX2, 0 C)
ISAS = {"avx2": (("-mno-avx512f",), 1), "plain": (("-mno-avx2",), 0)}


def load(head_size: int, group: int, isa: str):
    """The attention library of this shape, built for ``isa`` (``native`` or a key of ISAS)."""
    if isa == "native":
        return kcpu.load(head_size, group)
    flags, _ = ISAS[isa]
    return c_build.load_library(f"the CPU attention kernel ({isa})", cpu_attention.KERNEL_SOURCE,
                               cpu_attention._declare_attention,
                               (f"-DHEAD_SIZE={head_size}", f"-DGROUP={group}", *flags),
                               tag=f"h{head_size}-g{group}-{isa}")


def run(lib, case, query: torch.Tensor, starts: torch.Tensor | None, dtype: torch.dtype,
        window: int = 0, soft_cap: float = 0.0, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel on ``case`` in ``dtype`` (the caches in ``kv_dtype``, by default the same)."""
    kv_dtype = kv_dtype or dtype
    q, k, v = query.to(dtype), case.k_cache.to(kv_dtype), case.v_cache.to(kv_dtype)
    out = torch.empty_like(q)
    rc = lib.batchgen_paged_attention(
        out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), case.block_tables.data_ptr(),
        None if starts is None else starts.data_ptr(), case.context_lens.data_ptr(),
        case.context_lens.shape[0], q.shape[0], case.k_cache.shape[2], case.k_cache.shape[1],
        case.block_tables.shape[1], q.stride(0), q.stride(1), case.scale, k.shape[0],
        cpu_attention.DTYPES[dtype], cpu_attention.DTYPES[kv_dtype], window, soft_cap)
    assert rc == 0
    return out


def test_each_forced_build_runs_its_variant() -> None:
    native = 2 if c_build.missing_cpu_features("avx512f") is None else 1
    assert load(64, 3, "native").batchgen_attention_isa() == native
    for isa, (_, code) in ISAS.items():
        assert load(64, 3, isa).batchgen_attention_isa() == code, isa


@pytest.mark.parametrize("head_size,group,block_size", [
    (64, 3, 16),    # SmolLM2
    (40, 3, 16),    # a partial last 16 (8 + 0 lanes in the tail)
    (24, 1, 8),     # a tail of exactly 8 lanes; plain multi-head
    (100, 5, 16),   # a tail of 4; an odd group
    (80, 8, 32),    # a wide group
    (128, 4, 16),
    (256, 2, 16),   # a head over several passes of accumulators
    (12, 2, 1),     # no full 16 at all; one token per block
])
def test_the_avx2_build_gives_the_avx512_and_plain_c_bits(head_size: int, group: int, block_size: int) -> None:
    lens = [1, 7, block_size + 1, 130, 300]
    case = make_decode_case(dtype=torch.float32, head_size=head_size, block_size=block_size,
                            context_lens=lens, num_kv_heads=2, group=group, seed=head_size + group)
    gen = torch.Generator().manual_seed(head_size)
    q_lens = [1, 7, min(9, block_size + 1), 30, 45]  # rows of one tile stop at different keys
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefill_q = torch.randn(starts[-1].item(), *case.query.shape[1:], generator=gen)
    # scores far apart, so that most numerators meet the exp's clamp at -87
    steep_q = case.query * 40.0
    libs = {isa: load(head_size, group, isa) for isa in ("native", *ISAS)}
    for dtype in cpu_attention.DTYPES:
        for label, query, loc in (("decode", case.query, None), ("steep decode", steep_q, None),
                                  ("prefill", prefill_q, starts)):
            outs = {isa: run(lib, case, query, loc, dtype) for isa, lib in libs.items()}
            for isa in ISAS:
                assert torch.equal(outs[isa], outs["native"]), f"{label} {dtype}: {isa} differs from native"
            if label == "steep decode":
                continue  # scores in the hundreds: float32 rounding of a score moves the output more
            if loc is None:
                ref = reference.paged_decode_attention(query.to(dtype).float(), case.k_cache.to(dtype).float(),
                                                       case.v_cache.to(dtype).float(), case.block_tables,
                                                       case.context_lens, case.scale)
            else:
                ref = reference.paged_prefill_attention(query.to(dtype).float(), case.k_cache.to(dtype).float(),
                                                        case.v_cache.to(dtype).float(), case.block_tables,
                                                        loc, case.context_lens, case.scale)
            assert_close_to_reference(outs["avx2"], ref, dtype, f"{label} {dtype} h{head_size} g{group}")


@pytest.mark.parametrize("head_size,group", [(64, 3), (40, 1), (100, 4)])
def test_a_16_bit_cache_under_a_float32_query_reads_as_its_widened_values(head_size: int, group: int) -> None:
    """A bfloat16 or float16 cache under a float32 query (``kv_cache_dtype``) gives, in every
    build, exactly the bits of a float32 cache holding the same values: its rows are widened
    exactly and everything after is the float32 arithmetic."""
    case = make_decode_case(dtype=torch.float32, head_size=head_size, block_size=16,
                            context_lens=[1, 17, 130, 300], num_kv_heads=2, group=group, seed=head_size)
    q_lens = [1, 9, 30, 45]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefill_q = torch.randn(starts[-1].item(), *case.query.shape[1:], generator=torch.Generator().manual_seed(3))
    libs = {isa: load(head_size, group, isa) for isa in ("native", *ISAS)}
    for kv_dtype in (torch.bfloat16, torch.float16):
        widened = dataclasses.replace(case, k_cache=case.k_cache.to(kv_dtype).float(),
                                      v_cache=case.v_cache.to(kv_dtype).float())
        for label, query, loc in (("decode", case.query, None), ("prefill", prefill_q, starts)):
            want = run(libs["native"], widened, query, loc, torch.float32)
            for isa, lib in libs.items():
                got = run(lib, case, query, loc, torch.float32, kv_dtype=kv_dtype)
                assert got.dtype == torch.float32
                assert torch.equal(got, want), f"{label}, {kv_dtype} cache: {isa} differs"


@pytest.mark.parametrize("head_size,group,block_size,window,soft_cap", [
    (64, 3, 16, 16, 0.0),   # a window of one block, ending inside blocks
    (40, 3, 16, 7, 2.5),    # a window ending inside a block, soft-capped, a tail of 8 lanes
    (24, 1, 1, 20, 0.0),    # one token per block
    (128, 4, 16, 0, 1.5),   # soft-capped, no window
])
def test_windows_and_soft_caps_give_the_same_bits_in_every_build(head_size: int, group: int, block_size: int,
                                                                 window: int, soft_cap: float) -> None:
    """A windowed row's softmax lanes start at its own first key and the keys of its tile before
    that get numerators of exactly 0; the soft cap is libm's ``tanhf`` in every build: the AVX2
    and plain-C builds give the AVX-512 build's bits, and all are the torch reference's within
    float32 rounding."""
    lens = [1, 7, block_size + 1, 130, 300]
    case = make_decode_case(dtype=torch.float32, head_size=head_size, block_size=block_size,
                            context_lens=lens, num_kv_heads=2, group=group, seed=head_size + window)
    gen = torch.Generator().manual_seed(window)
    q_lens = [1, 7, min(9, block_size + 1), 30, 45]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefill_q = torch.randn(starts[-1].item(), *case.query.shape[1:], generator=gen)
    libs = {isa: load(head_size, group, isa) for isa in ("native", *ISAS)}
    options = {"sliding_window": window or None, "logits_soft_cap": soft_cap or None}
    for dtype in cpu_attention.DTYPES:
        k, v = case.k_cache.to(dtype).float(), case.v_cache.to(dtype).float()
        for label, query, loc in (("decode", case.query, None), ("prefill", prefill_q, starts)):
            outs = {isa: run(lib, case, query, loc, dtype, window, soft_cap) for isa, lib in libs.items()}
            for isa in ISAS:
                assert torch.equal(outs[isa], outs["native"]), f"{label} {dtype}: {isa} differs from native"
            q = query.to(dtype).float()
            if loc is None:
                ref = reference.paged_decode_attention(q, k, v, case.block_tables, case.context_lens, case.scale,
                                                       **options)
            else:
                ref = reference.paged_prefill_attention(q, k, v, case.block_tables, loc, case.context_lens,
                                                        case.scale, **options)
            assert_close_to_reference(outs["plain"], ref, dtype, f"{label} {dtype} window {window} cap {soft_cap}")


def load_fused(isa: str):
    """fused.c built for ``isa``: ``native``, ``avx2`` (-mno-avx512f) or ``plain`` (-mno-avx2)."""
    from batchgen.kernels.cpu import fused

    flags = () if isa == "native" else ISAS[isa][0]
    return c_build.load_library(f"the fused CPU ops ({isa})", fused.FUSED_SOURCE, fused._declare, flags,
                               tag="" if isa == "native" else isa)


def fused_outputs(lib, dtype: torch.dtype, width: int) -> list[torch.Tensor]:
    """RMSNorm (alone and after a residual add), SiLU·up and GELU-tanh·up, RoPE + cache write (and for float32
    the greedy pick) of one random problem, in ``dtype``, through ``lib``."""
    from batchgen.kernels.cpu.linear import DTYPES

    gen = torch.Generator().manual_seed(width)
    m, heads, kv_heads, d = 7, 3, 1, 40
    x = (torch.randn(m, width, generator=gen) * 3).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    gu = (torch.randn(m, 2 * width, generator=gen) * 4).to(dtype)
    h = (torch.randn(m, width, generator=gen) * 3).to(dtype)
    code = DTYPES[dtype]
    norm, act, gelu = torch.empty_like(x), torch.empty(m, width, dtype=dtype), torch.empty(m, width, dtype=dtype)
    total, added = torch.empty_like(x), torch.empty_like(x)
    args = (x.data_ptr(), width, w.data_ptr(), norm.data_ptr(), width, m, width, 1e-5)
    add_args = (x.data_ptr(), width, h.data_ptr(), width, w.data_ptr(), total.data_ptr(), added.data_ptr(), m,
                width, 1e-5)
    gu_args = (gu.data_ptr(), 2 * width, act.data_ptr(), width, m, width)
    gelu_args = (gu.data_ptr(), 2 * width, gelu.data_ptr(), width, m, width)
    if dtype is torch.float32:
        lib.batchgen_rms_norm_f32(*args)
        lib.batchgen_add_rms_norm_f32(*add_args)
        lib.batchgen_gated_mul_f32(*gu_args, 0)
        lib.batchgen_gated_mul_f32(*gelu_args, 1)
    else:
        lib.batchgen_rms_norm_16(*args, code)
        lib.batchgen_add_rms_norm_16(*add_args, code)
        lib.batchgen_gated_mul_16(*gu_args, code, 0)
        lib.batchgen_gated_mul_16(*gelu_args, code, 1)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angle = torch.rand(m, d, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    k_cache = torch.zeros(m + 2, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(m + 2, generator=gen)[:m].to(torch.int64)
    assert lib.batchgen_rope_cache(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), d, sin.data_ptr(), d,
                                   k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), m + 2, m,
                                   heads, kv_heads, d, code, code) == 0
    outs = [norm, total, added, act, gelu, qkv, k_cache, v_cache]
    if dtype is torch.float32:
        logits = torch.randn(m, width * 5, generator=gen) * 4
        ids, maxes, lse = torch.empty(m, dtype=torch.int64), torch.empty(m), torch.empty(m)
        lib.batchgen_greedy_f32(logits.data_ptr(), logits.stride(0), m, logits.shape[1], ids.data_ptr(),
                                maxes.data_ptr(), lse.data_ptr())
        outs += [ids, maxes, lse]
    return outs


@pytest.mark.parametrize("width", [576, 1000, 13])
def test_the_fused_ops_give_the_same_bits_in_every_build(width: int) -> None:
    """RMSNorm's sum of squares and the greedy pick's sum of exponentials are reductions: their
    lanes and their order are written out in fused.c, so an AVX2 build (and plain C, float32)
    gives an AVX-512 build's bits; the rest is element-wise. Widths: SmolLM2's hidden size, one
    with a tail, one under a vector. Against torch: tests/kernels/test_cpu_fused.py."""
    libs = {isa: load_fused(isa) for isa in ("native", *ISAS)}
    assert libs["avx2"].batchgen_fused_has_16() == 1
    for dtype in cpu_attention.DTYPES:
        outs = {isa: fused_outputs(lib, dtype, width) for isa, lib in libs.items()
                if dtype is torch.float32 or lib.batchgen_fused_has_16()}
        assert len(outs) >= 2
        for isa, got in outs.items():
            for i, (a, b) in enumerate(zip(got, outs["native"])):
                assert torch.equal(a, b), f"{dtype} width {width}: output {i} of the {isa} build differs"


@pytest.mark.parametrize("missing,warns", [({"avx512f", "avx512_bf16"}, True), ({"avx512_bf16"}, False), (set(), False)])
def test_bfloat16_asked_for_on_a_cpu_without_avx512_says_it_is_no_faster(monkeypatch, caplog, missing, warns) -> None:
    """Without AVX-512 or AVX512-BF16 the linear layers widen bfloat16 weights to float32 as they
    load (no faster than float32: docs/kernels.md, AVX2): an explicit bfloat16 logs one warning;
    ``auto`` is float32 on the CPU and says nothing."""
    import logging

    from batchgen.engine.model_loader import resolve_dtype

    monkeypatch.setattr(c_build, "missing_cpu_features",
                        lambda *names: ", ".join(n for n in names if n in missing) or None)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.model_loader"):
        assert resolve_dtype("auto", None, cpu) is torch.float32
        assert not caplog.records
        assert resolve_dtype("bfloat16", None, cpu) is torch.bfloat16
    assert [r for r in caplog.records if "bfloat16" in r.getMessage()] if warns else not caplog.records


def _capped(value: str, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter under ``BATCHGEN_CPU_ISA=value`` (the cap is read once a
    process)."""
    env = {**os.environ, "BATCHGEN_CPU_ISA": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_the_isa_cap_builds_every_kernel_for_avx2_and_hides_the_newer_features() -> None:
    """``BATCHGEN_CPU_ISA=avx2``: the quantized kernel runs its AVX2 variant and the fused ops
    build (the cap's flags are the forced AVX2 builds' above, so the disk cache already holds
    them); AVX-512 and AVX-VNNI read as missing; an unknown value is refused by name."""
    code = ("from batchgen.kernels.cpu import c_build, fused, quant\n"
            "fused.load_fused()\n"
            "print(quant.kernel_isa(), c_build.cpu_isa_cap(), c_build.missing_cpu_features('avx512f') is not None,\n"
            "      c_build.missing_cpu_features('avx2'))")
    done = _capped("avx2", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["avx2", "avx2", "True", "None"]
    done = _capped("sse4", "from batchgen.kernels.cpu import quant\nquant.load_quant()")
    assert done.returncode != 0 and "BATCHGEN_CPU_ISA='sse4' is not one of native, avx2" in done.stderr
