"""The ``cpu`` linear backend: batchgen's C GEMM (``kernels/cpu/linear.c``) behind ``PackedLinear``.

Checked against its torch reference (``kernels/cpu/reference.py``: the exact product, with the
rounding bound of a sequential float32 sum) in float32, bfloat16 and float16, for shapes that
hit every tile height, a partial last panel and several row blocks; bit-identical results at
1, 2 and 3 threads and whatever the batch around a row; the AVX2 build against the AVX-512 one;
strided input, the contract, layer replacement in a model, the run-time CPU check and how
``linear_backend`` resolves. A machine where the kernel cannot be built (no compiler, no
AVX2/FMA/F16C) skips with that reason.
"""

from __future__ import annotations

import logging
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu as kcpu
from batchgen.kernels.cpu import linear as cpu_linear
import cpu_reference as reference
from batchgen.kernels.cpu import c_build
from batchgen.kernels.cpu.linear import PackedLinear, pack_linears

_WHY = cpu_linear.unsupported_reason(torch.float32, torch.device("cpu"))
needs_kernel = pytest.mark.skipif(_WHY is not None, reason=f"the CPU linear kernel cannot run here: {_WHY}")
EPS = torch.finfo(torch.float32).eps


@pytest.fixture
def threads():
    """Set torch's intra-op thread count for one test, then restore it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.5)
        if bias:
            layer.bias.normal_(0, 1.0)
    return layer


# half a unit in the last place of each output dtype, relative (its own rounding)
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _assert_within_rounding(out: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> None:
    """|out - exact| <= (K + 2) eps sum_k |x_k w_k| + eps |b| (the bound of a sequential FMA
    sum, ``reference.linear_error_bound``), plus the output's own rounding in 16 bits."""
    w, b = layer.weight.detach(), layer.bias
    exact = F.linear(x.double(), w.double(), b.detach().double() if b is not None else None)
    bound = reference.linear_error_bound(x, w)
    if b is not None:
        bound = bound + EPS * b.detach().double().abs()
    bound = bound * (1 + HALF_ULP[out.dtype]) + HALF_ULP[out.dtype] * exact.abs()
    err = (out.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), f"max error {err.max():.3e}, max bound {bound.max():.3e}"
    if out.dtype == torch.float32:  # and the reference, rounded once, is as close
        ref = reference.linear(x, w, b.detach() if b is not None else None)
        assert bool(((out.double() - ref.double()).abs() <= 2 * bound + 1e-30).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(16, 64), (17, 7), (200, 577), (5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_within_rounding(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    layer = _linear(out_features, in_features, bias, seed=rows * 1000 + out_features)
    x = torch.randn(rows, in_features)
    out = PackedLinear(layer)(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    _assert_within_rounding(out, x, layer)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40])
@pytest.mark.parametrize("out_features,in_features", [(17, 7), (200, 577), (33, 96)])
def test_16_bit_matches_float64_within_rounding(dtype, rows, out_features, in_features) -> None:
    """bfloat16 / float16 weights and input, float32 sums (AVX512-BF16 pairs of k, or the values
    widened to float32), one rounding of the output; odd in_features exercise the last pair."""
    layer = _linear(out_features, in_features, True, seed=rows * 100 + in_features).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    out = PackedLinear(layer)(x)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    _assert_within_rounding(out, x, layer)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threads_and_batch_change_no_bit(kernel_threads, dtype) -> None:
    """The threads split output columns and row blocks, never the sum: every row, alone or in
    any batch, at 1, 2 or 3 threads, is bit-identical. in_features 1600 makes row blocks of
    about 24 rows (float32), so 97 rows span several."""
    layer = PackedLinear(_linear(200, 1600, True, seed=7).to(dtype))
    x = torch.randn(97, 1600).to(dtype)
    kernel_threads(1)
    want = layer(x)
    for n in (2, 3):
        kernel_threads(n)
        assert torch.equal(layer(x), want)
        for start, stop in ((0, 1), (5, 6), (3, 35), (40, 97), (96, 97)):
            assert torch.equal(layer(x[start:stop]), want[start:stop])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_avx2_build_agrees_with_the_native_one(dtype) -> None:
    """The AVX2 code (what a CPU without AVX-512 runs) against this machine's build: the same
    float32 multiply-add chain per output, so float32 and float16 agree bit for bit; bfloat16
    with AVX512-BF16 adds pairs of products, so the two agree within rounding."""
    layer = _linear(70, 99, True, seed=11).to(dtype)
    x = torch.randn(29, 99).to(dtype)
    native, avx2 = PackedLinear(layer), PackedLinear(layer, isa="avx2")
    if dtype != torch.bfloat16 or cpu_linear.bf16_path() == "avx2":
        assert torch.equal(native(x), avx2(x))
    else:
        _assert_within_rounding(avx2(x), x, layer)
    _assert_within_rounding(native(x), x, layer)


@needs_kernel
def test_a_row_does_not_depend_on_the_batch() -> None:
    """Every row is one FMA chain: alone, or at any place in any batch, bit for bit."""
    layer = PackedLinear(_linear(130, 96, True, seed=3))
    x = torch.randn(41, 96)
    full = layer(x)
    for i in (0, 5, 6, 17, 40):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
    for start, stop in ((0, 7), (3, 35), (12, 41)):
        assert torch.equal(layer(x[start:stop]), full[start:stop])
    assert torch.equal(layer(x), full)  # and reruns repeat


@needs_kernel
def test_strided_and_batched_input() -> None:
    layer = _linear(48, 40, True, seed=5)
    packed = PackedLinear(layer)
    wide = torch.randn(9, 50)
    x = wide[:, 3:43]  # rows 50 floats apart
    assert not x.is_contiguous()
    assert torch.equal(packed(x), packed(x.contiguous()))
    cube = torch.randn(2, 7, 40)
    assert torch.equal(packed(cube), packed(cube.reshape(14, 40)).reshape(2, 7, 48))
    transposed = torch.randn(40, 6).t()  # unit stride along rows, not columns
    assert torch.equal(packed(transposed), packed(transposed.contiguous()))
    assert packed(torch.empty(0, 40)).shape == (0, 48)


@needs_kernel
def test_contract_violations_raise() -> None:
    packed = PackedLinear(_linear(8, 16, False, seed=1))
    with pytest.raises(ValueError, match="float32 CPU input"):
        packed(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 CPU input"):  # the weight's dtype, no other
        packed(torch.randn(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"input \[\.\.\., 16\]"):
        packed(torch.randn(3, 15))
    with pytest.raises(RuntimeError, match="inference only"):
        packed(torch.randn(3, 16, requires_grad=True))
    with torch.no_grad():
        assert packed(torch.randn(3, 16, requires_grad=True)).shape == (3, 8)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 CPU weight"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.float64))
    with pytest.raises(RuntimeError, match="cannot be moved or cast"):
        packed.to(torch.bfloat16)


@needs_kernel
def test_pack_linears_replaces_the_layers_of_a_model(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 31, 77, 120, 7]])
    with torch.no_grad():
        before = model(ids).logits
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    unpacked = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    assert pack_linears(model) == len(linears) == 2 * 7 + 1  # 2 layers x (q k v o gate up down) + lm_head
    assert unpacked() is None  # the unpacked weight is freed, not kept beside the packed one
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert isinstance(model.lm_head, PackedLinear)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


@needs_kernel
def test_resolve_picks_the_kernel_at_any_thread_count(threads) -> None:
    cpu = torch.device("cpu")
    for n in (1, 2):
        threads(n)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert cpu_linear.resolve("auto", cpu, dtype) == ("cpu", None)
    assert cpu_linear.resolve("cpu", cpu, torch.float32) == ("cpu", None)  # asked for by name
    assert cpu_linear.resolve("torch", cpu, torch.float32) == ("torch", None)
    backend, why = cpu_linear.resolve("auto", cpu, torch.float64)
    assert backend == "torch" and "float32, bfloat16 and float16" in why
    with pytest.raises(ValueError, match="linear_backend='cpu' cannot serve this model: dtype"):
        cpu_linear.resolve("cpu", cpu, torch.float64)
    with pytest.raises(ValueError, match="linear_backend='cpu' cannot serve this model: the model runs on cuda"):
        cpu_linear.resolve("cpu", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, cpu, torch"):
        cpu_linear.resolve("mkl", cpu, torch.float32)


def test_a_cpu_without_avx2_falls_back_before_building(monkeypatch, tmp_path) -> None:
    """The flags are read at run time: a CPU without AVX2/FMA/F16C gets torch and the reason,
    and nothing is compiled (no illegal instruction can follow)."""
    monkeypatch.setattr(c_build, "cpu_flags", lambda: frozenset({"sse2", "avx", "fma"}))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(c_build, "_loaded", {})
    backend, why = cpu_linear.resolve("auto", torch.device("cpu"), torch.float32)
    assert backend == "torch" and why == "this CPU lacks AVX2, F16C (flags from /proc/cpuinfo)"
    with pytest.raises(ValueError, match="this CPU lacks AVX2, F16C"):
        cpu_linear.resolve("cpu", torch.device("cpu"), torch.float32)
    assert not (tmp_path / "cpu_kernels").exists() or not list((tmp_path / "cpu_kernels").iterdir())


@needs_kernel
def test_a_library_built_for_another_cpu_is_refused() -> None:
    """The build cache is keyed on the CPU's flags, and each library checks at load (cpuid)
    that the CPU runs what it was built for; one that does not is refused, never called."""
    if c_build.cpu_flags() is not None:
        assert c_build.cpu_flags() <= set(c_build._machine_tag().split())
    lib = cpu_linear.load_linear()
    assert lib.batchgen_linear_cpu_ok() == 1 and cpu_linear._runs_here(lib) is None
    foreign = types.SimpleNamespace(batchgen_linear_cpu_ok=lambda: 0)
    assert cpu_linear._runs_here(foreign) == "built for instructions this CPU lacks"


@pytest.mark.skipif(kcpu.compiler() is None, reason="no C compiler (cc/gcc) on this machine")
def test_a_kernel_that_does_not_build_falls_back(tmp_path, monkeypatch, threads) -> None:
    """A broken source (or a compiler that refuses the ISA) fails the build: ``auto`` keeps
    torch, ``cpu`` says why."""
    broken = tmp_path / "linear.c"
    broken.write_text('#error "no AVX2 here"\n')
    monkeypatch.setattr(cpu_linear, "LINEAR_SOURCE", broken)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    backend, why = cpu_linear.resolve("auto", torch.device("cpu"), torch.float32)
    assert backend == "torch" and "could not build the CPU linear kernel" in why and "no AVX2 here" in why
    with pytest.raises(ValueError, match="could not build the CPU linear kernel"):
        cpu_linear.resolve("cpu", torch.device("cpu"), torch.float32)


@needs_kernel
def test_the_engine_packs_its_layers(tiny_model, threads, kernel_threads, caplog) -> None:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.llm import load_runner

    path = tiny_model("qwen2")  # q/k/v with bias
    threads(2)  # at any thread count
    with caplog.at_level(logging.INFO, logger="batchgen.engine"):
        runner = load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20, num_threads=2))
    assert runner.linear_backend == "cpu" and "layers packed" in caplog.text
    assert "threads: C kernels on 2 thread(s), torch on 1" in caplog.text
    assert c_build.num_threads() == 2 and torch.get_num_threads() == 1
    attn = runner.model.model.layers[0].self_attn  # fused: q, k and v packed as one, with their biases
    assert isinstance(attn.qkv_proj, PackedLinear) and isinstance(attn.o_proj, PackedLinear)
    assert attn.qkv_proj.padded_bias is not None
    maps = Path("/proc/self/maps")
    if maps.is_file():  # the checkpoint's memory map (unpacked weights included) is let go
        assert str(Path(path) / "model.safetensors") not in maps.read_text()
    runner = load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20, linear_backend="torch"))
    assert runner.linear_backend == "torch"
    assert type(runner.model.lm_head) is torch.nn.Linear
