"""The ``cpu`` linear backend: batchgen's C GEMM (``kernels/cpu/linear.c``) behind ``PackedLinear``.

Checked against a float64 ``F.linear`` with the rounding bound of a sequential sum, for
shapes that hit every tile height and a partial last panel; batch invariance, strided input,
the contract, layer replacement in a model, and how ``linear_backend`` resolves. A machine
where the kernel cannot be built (no compiler, no AVX2/FMA) skips with that reason.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu as kcpu
from batchgen.kernels.cpu import linear as cpu_linear
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


def _assert_within_rounding(out: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> None:
    """|out - exact| <= (K + 2) eps sum_k |x_k w_k| + eps |b|: the bound of a sequential FMA sum."""
    w, b = layer.weight.detach().double(), layer.bias
    exact = F.linear(x.double(), w, b.detach().double() if b is not None else None)
    bound = (x.shape[-1] + 2) * EPS * F.linear(x.double().abs(), w.abs())
    if b is not None:
        bound = bound + EPS * b.detach().double().abs()
    err = (out.double() - exact).abs()
    assert bool((err <= bound + 1e-30).all()), f"max error {err.max():.3e}, max bound {bound.max():.3e}"


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
    with pytest.raises(ValueError, match=r"input \[\.\.\., 16\]"):
        packed(torch.randn(3, 15))
    with pytest.raises(RuntimeError, match="inference only"):
        packed(torch.randn(3, 16, requires_grad=True))
    with torch.no_grad():
        assert packed(torch.randn(3, 16, requires_grad=True)).shape == (3, 8)
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.bfloat16))


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
def test_resolve_picks_the_kernel_for_one_thread(threads) -> None:
    cpu = torch.device("cpu")
    threads(1)
    assert cpu_linear.resolve("auto", cpu, torch.float32) == ("cpu", None)
    threads(2)
    backend, why = cpu_linear.resolve("auto", cpu, torch.float32)
    assert backend == "torch" and "2 threads" in why
    assert cpu_linear.resolve("cpu", cpu, torch.float32) == ("cpu", None)  # asked for by name
    assert cpu_linear.resolve("torch", cpu, torch.float32) == ("torch", None)
    threads(1)
    backend, why = cpu_linear.resolve("auto", cpu, torch.bfloat16)
    assert backend == "torch" and "float32 only" in why
    with pytest.raises(ValueError, match="linear_backend='cpu' cannot serve this model: dtype"):
        cpu_linear.resolve("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="linear_backend='cpu' cannot serve this model: the model runs on cuda"):
        cpu_linear.resolve("cpu", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, cpu, torch"):
        cpu_linear.resolve("mkl", cpu, torch.float32)


@pytest.mark.skipif(kcpu.compiler() is None, reason="no C compiler (cc/gcc) on this machine")
def test_a_kernel_that_does_not_build_falls_back(tmp_path, monkeypatch, threads) -> None:
    """No AVX2/FMA (or a broken source) fails the build: ``auto`` keeps torch, ``cpu`` says why."""
    threads(1)
    broken = tmp_path / "linear.c"
    broken.write_text('#error "no AVX2 here"\n')
    monkeypatch.setattr(cpu_linear, "LINEAR_SOURCE", broken)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    backend, why = cpu_linear.resolve("auto", torch.device("cpu"), torch.float32)
    assert backend == "torch" and "could not build the CPU linear kernel" in why and "no AVX2 here" in why
    with pytest.raises(ValueError, match="could not build the CPU linear kernel"):
        cpu_linear.resolve("cpu", torch.device("cpu"), torch.float32)


@needs_kernel
def test_the_engine_packs_its_layers(tiny_model, threads, caplog) -> None:
    from batchgen.engine.model_runner import ModelRunner

    path = tiny_model("qwen2")  # q/k/v with bias
    threads(1)
    with caplog.at_level(logging.INFO, logger="batchgen.engine.model_runner"):
        runner = ModelRunner(path, dtype="float32", device="cpu", kv_cache_memory=2**20)
    assert runner.linear_backend == "cpu" and "layers packed" in caplog.text
    assert isinstance(runner.model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert runner.model.model.layers[0].self_attn.q_proj.padded_bias is not None
    maps = Path("/proc/self/maps")
    if maps.is_file():  # the checkpoint's memory map (unpacked weights included) is let go
        assert str(Path(path) / "model.safetensors") not in maps.read_text()
    threads(2)
    runner = ModelRunner(path, dtype="float32", device="cpu", kv_cache_memory=2**20)
    assert runner.linear_backend == "torch"
    assert type(runner.model.lm_head) is torch.nn.Linear
