"""The quantized linear kernel (``kernels/cpu/quant.c`` behind ``QuantizedLinear``).

For every format and every instruction-set build (``native``: AVX512-VNNI where the CPU has it,
``avx2`` forced, ``avxvnni`` forced (AVX2 with the 256-bit ``vpdpbusd``; where the CPU has
AVX-VNNI), ``plain`` C), at 1, 3, 7, 32 and 300 rows (1-4 rows take the kernel's GEMV path, more
its tiles): the kernel equals its arithmetic
written out in torch (``quant_arith.py``: the same int8 activations, exact integer dot products,
the same float32 order) bit for bit, so the builds agree bit for bit; and it lies within the
stated bound (``quant_arith.activation_error_bound``) of the exact product with the weight as
``gguf`` de-quantizes it. Batch invariance (a row alone or inside a batch, 1 or 2 threads),
non-finite rows, 16-bit inputs, the embedded model's own tensors, and the torch fallback.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchgen.kernels.cpu import c_build, quant
from batchgen.kernels.cpu.quant import QuantizedLinear
from batchgen.kernels.cpu.quant_formats import QUANT_FORMATS

import quant_arith
from test_quant_dequant import _embedded_reader, quantized

_WHY = quant.unsupported_reason()
needs_kernel = pytest.mark.skipif(_WHY is not None, reason=f"the quantized CPU kernel cannot run here: {_WHY}")
ISAS = ("native", "avx2", "avxvnni", "plain")
# the /proc/cpuinfo features a forced build needs (the native build runs wherever the kernel does)
NEEDS = {"avx2": ("avx2",), "avxvnni": ("avx2", "avx_vnni")}


def _isa_or_skip(isa: str) -> None:
    why = c_build.missing_cpu_features(*NEEDS.get(isa, ()))
    if why is not None:
        pytest.skip(f"the {isa} build cannot run here: {why}")
    try:
        quant.load_quant(isa)
    except c_build.CpuKernelError as exc:
        pytest.skip(f"the {isa} build cannot run here: {str(exc).splitlines()[0]}")


@pytest.fixture
def pool_threads():
    before = c_build.num_threads()
    yield c_build.set_num_threads
    c_build.set_num_threads(before)


def _exact(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """The exact product with the weight as gguf de-quantizes it (float64)."""
    w = gguf.quants.dequantize(layer.raw_rows().numpy(), layer.qtype)
    y = x.double() @ torch.from_numpy(w).double().T
    return y if layer.bias is None else y + layer.bias.double()


def _check(y: torch.Tensor, x: torch.Tensor, layer: QuantizedLinear) -> None:
    raw = layer.raw_rows()
    assert torch.equal(y, quant_arith.quant_linear(x, raw, layer.qtype, layer.in_features, layer.bias))
    bound = quant_arith.activation_error_bound(x, layer.dequantized_weight(), layer.qtype)
    err = (y.double() - _exact(x, layer)).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3e}, bound there {bound.flatten()[err.argmax()]:.3e}"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 300])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_FORMATS, ids=lambda t: t.name)
def test_equals_its_arithmetic_and_the_reference_within_the_bound(qtype: Q, isa: str, rows: int) -> None:
    _isa_or_skip(isa)
    n, k = 40, 512  # two and a half panels; 16 blocks of 32 or 2 of 256
    torch.manual_seed(rows)
    bias = torch.randn(n) if rows % 2 else None
    layer = QuantizedLinear(quantized(qtype, n, k, seed=int(qtype)), qtype, n, k, bias=bias, isa=isa)
    assert layer.isa == isa
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
    _check(layer(x), x, layer)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_FORMATS, ids=lambda t: t.name)
def test_odd_shapes(qtype: Q, isa: str) -> None:
    """One output column, outputs not a multiple of the 16-column panel, and (for the types of
    32-value blocks) K not a multiple of 256, on both the GEMV path (1-4 rows) and the tiles."""
    _isa_or_skip(isa)
    bs = quant.block_size(qtype)
    torch.manual_seed(int(qtype))
    for n, k in ((1, 3 * bs), (17, bs), (33, 5 * bs if bs == 32 else 2 * bs)):
        layer = QuantizedLinear(quantized(qtype, n, k, seed=n), qtype, n, k, bias=torch.randn(n), isa=isa)
        for rows in (1, 4, 9):
            x = torch.randn(rows, k)
            _check(layer(x), x, layer)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_the_gemv_path_and_the_tiles_agree(isa: str) -> None:
    """A row's bits are the same whether its call has 1-4 rows (the GEMV path) or more (the
    tiles), at any position in the call."""
    _isa_or_skip(isa)
    torch.manual_seed(1)
    x = torch.randn(9, 512)
    for qtype in QUANT_FORMATS:
        layer = QuantizedLinear(quantized(qtype, 24, 512, seed=3), qtype, 24, 512, isa=isa)
        full = layer(x)
        for lo, hi in ((0, 1), (2, 4), (5, 9), (3, 7), (8, 9)):
            assert torch.equal(layer(x[lo:hi]), full[lo:hi]), (qtype.name, lo, hi)


@needs_kernel
@pytest.mark.parametrize("qtype", QUANT_FORMATS, ids=lambda t: t.name)
def test_the_builds_agree_bit_for_bit(qtype: Q) -> None:
    n, k = 50, 768
    raw = quantized(qtype, n, k, seed=7)
    x, bias = torch.randn(70, k), torch.randn(n)
    outs = {}
    for isa in ISAS:
        _isa_or_skip(isa)
        outs[isa] = QuantizedLinear(raw, qtype, n, k, bias=bias, isa=isa)(x)
    for isa, y in outs.items():
        assert torch.equal(y, outs["native"]), isa


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_a_row_does_not_depend_on_its_batch_or_the_threads(qtype: Q, pool_threads) -> None:
    n, k = 200, 512
    layer = QuantizedLinear(quantized(qtype, n, k, seed=11), qtype, n, k)
    torch.manual_seed(0)
    batch = torch.randn(150, k)
    pool_threads(1)
    alone = torch.cat([layer(batch[i:i + 1]) for i in (0, 63, 64, 149)])
    pool_threads(2)
    full = layer(batch)
    assert torch.equal(full[[0, 63, 64, 149]], alone)
    assert torch.equal(layer(batch[60:70])[3:5], full[63:65])
    assert torch.equal(layer(batch[62:65]), full[62:65])  # 3 rows (the GEMV path) on 2 threads
    pool_threads(1)
    assert torch.equal(layer(batch), full)


@needs_kernel
def test_non_finite_inputs_poison_their_own_row_only() -> None:
    n, k = 24, 64
    layer = QuantizedLinear(quantized(Q.Q4_0, n, k, seed=1), Q.Q4_0, n, k)
    x = torch.randn(4, k)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    y = layer(x)
    assert bool(y[1].isnan().all()) and bool(y[2].isnan().all())
    assert torch.equal(y[[0, 3]], layer(x[[0, 3]]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_round_the_float32_result_once(dtype: torch.dtype) -> None:
    n, k = 32, 256
    layer = QuantizedLinear(quantized(Q.Q6_K, n, k, seed=2), Q.Q6_K, n, k, bias=torch.randn(n))
    x = torch.randn(2, 3, k).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    assert torch.equal(y, layer(x.float()).to(dtype))


@needs_kernel
def test_the_embedded_models_tensors() -> None:
    """A Q4_1 layer of SmolLM2 and a slice of its Q8_0 embedding (its tied lm_head)."""
    reader = _embedded_reader()
    tensors = {t.name: t for t in reader.tensors}
    torch.manual_seed(0)
    for name, rows in (("blk.0.ffn_down.weight", None), ("blk.0.attn_q.weight", None), ("token_embd.weight", 1024)):
        t = tensors[name]
        data = np.asarray(t.data)[:rows] if rows else np.asarray(t.data)
        n, k = data.shape[0], int(t.shape[0])
        layer = QuantizedLinear(data, t.tensor_type, n, k)
        x = torch.randn(9, k)
        _check(layer(x), x, layer)


@needs_kernel
def test_concat_computes_each_part() -> None:
    k = 256
    parts = [QuantizedLinear(quantized(Q.Q4_K, n, k, seed=n), Q.Q4_K, n, k) for n in (24, 8, 40)]
    fused = QuantizedLinear.concat(parts)
    x = torch.randn(5, k)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    perm = torch.randperm(72)
    assert torch.equal(fused.select_rows(perm)(x), fused(x)[:, perm])


def test_without_the_kernel_layers_run_the_torch_reference(monkeypatch, caplog) -> None:
    def broken(isa="native"):  # noqa: ANN001, ANN202
        raise c_build.CpuKernelError("no C compiler found (set CC, or install gcc)")

    monkeypatch.setattr(quant, "load_quant", broken)
    monkeypatch.setattr(quant, "_fallback_logged", False)
    n, k = 16, 64
    raw = quantized(Q.Q4_1, n, k, seed=3)
    with caplog.at_level("WARNING"):
        layer = QuantizedLinear(raw, Q.Q4_1, n, k)
    assert layer.isa == "torch" and "no C compiler found" in caplog.text
    x = torch.randn(3, k)
    assert torch.equal(layer(x), quant.reference_linear(x, layer.dequantized_weight(), None))
    with pytest.raises(c_build.CpuKernelError):
        QuantizedLinear(raw, Q.Q4_1, n, k, isa="avx2")


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda t: t.name)
def test_activation_rounding_ties_go_to_even(isa: str, qtype: Q) -> None:
    """A block whose largest magnitude is 127 has the scale 1: its halves are ties, rounded to
    even in every build (as torch.round, the model in ``quant_arith``); a zero block stays zero."""
    _isa_or_skip(isa)
    bs = quant.block_size(qtype)
    k = 2 * bs
    x = torch.zeros(3, k)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x[0, :bs] = ties.repeat(bs // 8)
    x[0, 0] = 127.0
    x[1] = torch.randn(k)
    q, d, s16 = quant_arith.kernel_quantization(x, qtype, isa=isa)
    q2, d2, s2 = quant_arith.quantize_activations(x, bs)
    assert torch.equal(q.int(), q2) and torch.equal(d, d2) and torch.equal(s16, s2.int())
    assert q[0, 1:8].tolist() == [2, 2, 0, -2, -2, 126, -126] and bool((q[2] == 0).all()) and d[2, 0] == 0
    layer = QuantizedLinear(quantized(qtype, 16, k, seed=5), qtype, 16, k, isa=isa)
    _check(layer(x), x, layer)


def test_gather_rows_reads_the_rows_from_the_panels() -> None:
    for qtype in QUANT_FORMATS:
        n, k = 37, 2 * quant.block_size(qtype)
        layer = QuantizedLinear(quantized(qtype, n, k, seed=9), qtype, n, k, isa="torch")
        index = torch.tensor([36, 0, 5, 5, 17, 31])
        assert torch.equal(layer.gather_rows(index), layer.raw_rows()[index])


@needs_kernel
def test_each_build_runs_the_instructions_it_is_named_for() -> None:
    """A source that fails to compile with -march=native would silently load a lower flag set;
    the builds must say what they run: the native one what this CPU has."""
    flags = c_build.cpu_flags() or frozenset()
    expected = ("avx512_vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags
                else "avx_vnni" if {"avx2", "avx_vnni"} <= flags
                else "avx2" if "avx2" in flags else "plain C")
    assert quant.kernel_isa("native") == expected
    assert quant.kernel_isa("plain") == "plain C"
    if "avx2" in flags:
        assert quant.kernel_isa("avx2") == "avx2"
    if {"avx2", "avx_vnni"} <= flags:
        assert quant.kernel_isa("avxvnni") == "avx_vnni"


@needs_kernel
@pytest.mark.skipif(not ("avx2" in (c_build.cpu_flags() or ()) and c_build.missing_cpu_features("avx_vnni")),
                    reason="needs a CPU with AVX2 but without AVX-VNNI")
def test_the_avxvnni_build_is_refused_without_avx_vnni() -> None:
    """Built for AVX-VNNI, the library's own cpuid check refuses it on a CPU without it, so
    it never runs there (native then is the plain AVX2 build)."""
    with pytest.raises(c_build.CpuKernelError, match="instructions this CPU lacks"):
        quant.load_quant("avxvnni")


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_refuses_a_type_outside_its_table(isa: str) -> None:
    """Every type of QUANT_FORMATS runs in every build, and any other id is refused (-2), not
    read as some other type's blocks (the last row, Q6_K, once was the switch's default)."""
    _isa_or_skip(isa)
    lib = quant.load_quant(isa)
    layer = QuantizedLinear(quantized(Q.Q6_K, 16, 256, seed=4), Q.Q6_K, 16, 256, isa=isa)
    x, y = torch.randn(2, 256), torch.zeros(2, 16)

    def run(qtype: int) -> int:
        return lib.batchgen_quant_linear(x.data_ptr(), 256, 2, 256, layer.packed.data_ptr(), qtype, 16, None,
                                         y.data_ptr(), 16)

    assert run(int(Q.Q6_K)) == 0 and torch.equal(y, layer(x))
    for other in (Q.F16, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, 99):
        assert int(other) not in {int(t) for t in QUANT_FORMATS}
        y.zero_()
        assert run(int(other)) == -2 and bool((y == 0).all())


@pytest.mark.parametrize("isa", (*ISAS, "torch"))
@pytest.mark.parametrize("qtype", QUANT_FORMATS, ids=lambda t: t.name)
def test_a_lookup_of_rows_equals_gguf_s_de_quantization_bit_for_bit(qtype: Q, isa: str) -> None:
    """``dequantized_rows`` (the token embedding's lookups: quant_lookup.h in every build, torch
    for ``torch``) gives ``gguf``'s values of the rows asked for, in their order, repeats
    included, on 37 rows (three panels, the last one short); an index out of range is an
    IndexError, nothing read."""
    if isa != "torch":
        _isa_or_skip(isa)
    n, k = 37, 2 * quant.block_size(qtype)
    raw = quantized(qtype, n, k, seed=int(qtype) + 7)
    layer = QuantizedLinear(raw, qtype, n, k, isa=isa)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(n, k)
    index = torch.tensor([36, 0, 15, 16, 31, 32, 5, 5])
    got = layer.dequantized_rows(index)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want[index].view(torch.int32))
    assert layer.dequantized_rows(torch.tensor([], dtype=torch.long)).shape == (0, k)
    for bad in ([0, 37], [-1]):
        with pytest.raises(IndexError, match=r"row index out of range \[0, 37\)"):
            layer.dequantized_rows(torch.tensor(bad))
