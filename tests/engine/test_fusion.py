"""The model's fusion on the CPU path (``engine/fusion.py``) and its norm and MLP layers
(``engine/fused_layers.py``); the attention layer has its own tests
(tests/engine/test_fused_attention.py), GGUF's quantized layers too (tests/gguf/test_gguf_fusion.py).

Norms and gated MLPs of a tiny Llama are fused and the model's logits stay within float32
rounding, and Gemma's (its norm scales by ``1 + weight``, its MLP gates by GELU-tanh) in
float32; a norm or an activation of other semantics stays. Merging
``nn.Linear`` layers gives each output column the bits the packed layer alone gives. A machine
where the C ops cannot be built skips with that reason.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from batchgen.engine import fused_layers, fusion
from batchgen.engine.fused_layers import FusedGatedMLP, FusedRMSNorm, merge_linears, mergeable
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu.linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(
    not cpu_fused.available() or cpu_linear.unsupported_reason(torch.float32, torch.device("cpu")) is not None,
    reason="the CPU linear kernel or the fused CPU ops cannot be built here")

NORMS_AND_MLPS = ("rms_norm", "gated_mlp")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_norms_and_mlps_of_a_llama_are_fused(tiny_model) -> None:
    model = _load(tiny_model("llama"))
    ids = torch.tensor([[5, 9, 31, 77, 120, 7]])
    before = _logits(model, ids)
    gate = weakref.ref(model.model.layers[0].mlp.gate_proj.weight)
    counts = fusion.fuse_model(model, kinds=NORMS_AND_MLPS)
    assert counts == {"rms_norm": 2 * 2 + 1, "gated_mlp": 2, "attention": 0, "decoder_layer": 0, "decoder": 0,
                      "rejected": 0}
    assert isinstance(model.model.norm, FusedRMSNorm)
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp, FusedGatedMLP) and isinstance(mlp.gate_up_proj, PackedLinear)
    assert mlp.gate_up_proj.out_features == 2 * 128
    assert gate() is None  # the unpacked gate weight is not kept
    assert pack_linears(model) == 2 * 4 + 1  # what is left: q k v o per layer, and lm_head
    after = _logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_gemma_norms_and_gelu_mlps_are_fused_in_float32(tiny_model) -> None:
    """Gemma's norm scales by ``1 + weight`` (the second of fused_layers.NORM_FORMS) and its MLP gates by
    GELU-tanh: both fuse in float32, and the logits stay within rounding."""
    model = _load(tiny_model("gemma", head_dim=16))
    ids = torch.tensor([[5, 9, 31, 77]])
    before = _logits(model, ids)
    weight = model.model.norm.weight.detach().clone()
    counts = fusion.fuse_model(model, kinds=NORMS_AND_MLPS)
    assert counts["rms_norm"] == 2 * 2 + 1 and counts["gated_mlp"] == 2 and counts["rejected"] == 0
    assert torch.equal(model.model.norm.weight, 1.0 + weight)
    assert {layer.mlp.activation for layer in model.model.layers} == {"gelu_tanh"}
    after = _logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


class ScaledRMSNorm(torch.nn.Module):
    """An RMSNorm by its attributes that computes another function: ``3 w x̂`` (with w = 1, ``2 w x̂``
    would be Gemma's form)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight.clone()), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_other_semantics_are_left_alone(tiny_model) -> None:
    """A norm of neither form fails the probe and stays; an MLP gated by an activation of no
    ACTIVATIONS row (exact GELU) is no candidate."""
    model = _load(tiny_model("llama"))
    model.model.norm = ScaledRMSNorm(model.model.norm.weight.detach(), 1e-6)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    ids = torch.tensor([[5, 9, 31, 77]])
    before = _logits(model, ids)
    counts = fusion.fuse_model(model, kinds=NORMS_AND_MLPS)
    assert counts["rms_norm"] == 2 * 2 and counts["gated_mlp"] == 1 and counts["rejected"] == 1
    assert type(model.model.norm) is ScaledRMSNorm and not isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    assert fused_layers.activation_of(torch.nn.GELU()) is None
    with pytest.raises(ValueError, match="unknown activation None; known: silu, gelu_tanh"):
        FusedGatedMLP.of(model.model.layers[0].mlp)  # not taken for SiLU
    assert fused_layers.activation_of(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert fused_layers.activation_of(torch.nn.SiLU()) == "silu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_norms_fuse_in_16_bits_with_a_float32_weight(tiny_model, dtype) -> None:
    """In a 16-bit Gemma the fused norm keeps ``1 + weight`` in float32 (rounded to 16 bits it
    would no longer be Gemma's: the weights below are not 16-bit numbers once 1 is added) and
    scales the float32 row by it before the one rounding: every norm fuses, within a rounding of
    HF's (bit for bit in bfloat16 here)."""
    model = _load(tiny_model("gemma", head_dim=16)).to(dtype)
    for norm in [model.model.norm] + [n for layer in model.model.layers for n in (layer.input_layernorm,
                                                                                  layer.post_attention_layernorm)]:
        norm.weight.data.uniform_(-0.9, 0.9)
    weight = model.model.norm.weight.detach().clone()
    probe = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    want = model.model.norm(probe)
    counts = fusion.fuse_model(model, kinds=("rms_norm",))
    assert counts["rms_norm"] == 2 * 2 + 1 and counts["rejected"] == 0
    assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.weight.dtype is torch.float32
    assert torch.equal(model.model.norm.weight, 1.0 + weight.float())
    assert not torch.equal(model.model.norm.weight.to(dtype).float(), 1.0 + weight.float())
    got = model.model.norm(probe)
    assert got.dtype is dtype
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    assert bool(((got.float() - want.float()).abs() <= ulp * want.float().abs()).all())
    if dtype is torch.bfloat16:
        assert torch.equal(got, want)


def test_kinds_left_out_stay_and_unknown_kinds_are_refused(tiny_model) -> None:
    model = _load(tiny_model("llama"))
    assert fusion.fuse_model(model, kinds=("gated_mlp",))["rms_norm"] == 0
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
    assert all(isinstance(layer.mlp, FusedGatedMLP) for layer in model.model.layers)
    with pytest.raises(ValueError, match="unknown fusion kinds.*'rope'"):
        fusion.fuse_model(model, kinds=("rms_norm", "rope"))


def _linear(out_features: int, in_features: int, seed: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).eval()


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_merged_linears_give_each_packed_layers_bits(rows) -> None:
    """q/k/v-shaped ``nn.Linear`` layers (with biases, widths off the 16-column panels) merged
    into one PackedLinear: each column block equals that layer packed alone, bit for bit."""
    layers = [_linear(48, 40, 0, bias=True), _linear(24, 40, 1, bias=True), _linear(24, 40, 2, bias=True)]
    alone = [PackedLinear(layer) for layer in layers]
    merged = merge_linears(layers)
    assert isinstance(merged, PackedLinear) and merged.out_features == 96
    x = torch.randn(1, rows, 40, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(merged(x), torch.cat([layer(x) for layer in alone], dim=-1))


def test_linears_that_do_not_merge() -> None:
    a, b = _linear(8, 16, 0), _linear(8, 16, 1, bias=True)
    assert not mergeable([a, b], torch.float32)  # a bias on one only
    assert not mergeable([a, _linear(8, 32, 2)], torch.float32)  # other input widths
    assert not mergeable([a], torch.bfloat16)  # not the model's dtype
    assert not mergeable([_linear(8, 16, 3).double()], torch.float64)  # no C GEMM for it
    assert not mergeable([torch.nn.Identity()], torch.float32)
    assert mergeable([a, _linear(4, 16, 4)], torch.float32)
    with pytest.raises(ValueError, match="merge_linears needs"):
        merge_linears([a, b])


class _RowsSeen(torch.nn.Module):
    """A projection that records the rows of each input it is given, then runs ``inner``."""

    def __init__(self, inner: torch.nn.Module, reads_step_rows: bool = False) -> None:
        super().__init__()
        self.inner, self.rows, self.reads_step_rows = inner, [], reads_step_rows
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.inner(x)


def _mlp() -> FusedGatedMLP:
    return FusedGatedMLP([_linear(96, 40, 0), _linear(96, 40, 1)], _linear(40, 96, 2))


def test_the_mlp_takes_many_rows_a_slice_at_a_time_with_the_same_bits(monkeypatch) -> None:
    """Rows beyond one slice's bytes go through in slices of whole 16-row panels; each row's
    output is the one the whole batch gave, bit for bit, in the input's shape."""
    mlp = _mlp()
    x = torch.randn(2, 45, 40, generator=torch.Generator().manual_seed(3))
    whole = mlp(x)
    assert mlp.slice_rows() > 90  # the default budget: these rows went through at once
    monkeypatch.setattr(fused_layers, "SLICE_BYTES", 20 * 4 * 192)  # 20 rows of gate/up output
    assert mlp.slice_rows() == 16
    mlp.gate_up_proj = _RowsSeen(mlp.gate_up_proj)
    mlp.down_proj = _RowsSeen(mlp.down_proj)
    got = mlp(x)
    assert got.shape == (2, 45, 40) and torch.equal(got, whole)
    assert mlp.gate_up_proj.rows == mlp.down_proj.rows == [16] * 5 + [10]


def test_a_projection_that_reads_the_steps_rows_gets_them_whole(monkeypatch) -> None:
    """A LoRA layer indexes its adapter slots by the step's row: the MLP does not slice then."""
    from batchgen.lora.layers import LoRALinear

    assert LoRALinear.reads_step_rows
    monkeypatch.setattr(fused_layers, "SLICE_BYTES", 16 * 4 * 192)
    mlp = _mlp()
    x = torch.randn(1, 40, 40, generator=torch.Generator().manual_seed(4))
    whole = mlp(x)
    mlp.down_proj = _RowsSeen(mlp.down_proj, reads_step_rows=True)
    mlp.gate_up_proj = _RowsSeen(mlp.gate_up_proj)
    assert torch.equal(mlp(x), whole)
    assert mlp.gate_up_proj.rows == mlp.down_proj.rows == [40]
