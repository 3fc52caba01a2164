"""The fused decoder layer of the CPU path (``engine/fused_decoder.py``, fused by
``engine/fusion.py`` once a layer's norms, attention and MLP all fused).

A tiny Llama's layers become :class:`FusedDecoderLayer`; beyond the probe, on another step, a
layer gives HF's decoder-layer forward over the same parts bit for bit. A layer of other
semantics fails the probe and stays: Granite's scaled residuals. The decoder whose layers all
fused runs the engine's steps by its lean forward, HF's logits and K/V bit for bit, and one of
other semantics fails its probe. Whole runs, fused against
unfused, are pinned bit for bit in test_fused_attention.py (SmolLM2) and
tests/gguf/test_gguf_fusion.py (quantized layers), whose fused runs include these layers. A
machine where the C ops cannot be built skips with that reason.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import fusion, paged_attention
from batchgen.engine.fused_attention import FusedAttention
from batchgen.engine.fused_decoder import FusedDecoderLayer, LeanDecoderForward
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_fused.available() or cpu_linear.unsupported_reason(torch.float32, torch.device("cpu")) is not None,
    reason="the CPU linear kernel or the fused CPU ops cannot be built here")


def _load(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=paged_attention.register()).eval()


def _all_prefill_probe(model: torch.nn.Module, dtype: torch.dtype) -> fusion._Probe:
    """The fusion's probe, its step made another one: two prefill chunks, no decode."""
    probe = fusion._Probe(fusion._rotary_embedding(model), 64, 2, 2, 16, dtype)
    probe.meta.num_decode_tokens = 0
    probe.meta.prefill_block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    probe.meta.prefill_query_start_loc = torch.tensor([0, 1, 5], dtype=torch.int32)
    probe.meta.prefill_context_lens = torch.tensor([6, 6], dtype=torch.int32)
    return probe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_llamas_layers_are_fused_and_give_hfs_layer_bits(tiny_model, dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _load(tiny_model("llama", head_dim=16), dtype)
    counts = fusion.fuse_model(model)
    assert counts == {"rms_norm": 2 * 2 + 1, "gated_mlp": 2, "attention": 2, "decoder_layer": 2, "decoder": 1,
                      "rejected": 0}
    layer = model.model.layers[1]
    assert isinstance(layer, FusedDecoderLayer) and isinstance(layer.self_attn, FusedAttention)
    probe = _all_prefill_probe(model, dtype)
    hf_forward = LlamaDecoderLayer.forward.__wrapped__  # inside the gradient-checkpointing wrapper
    want, want_cache = probe.run(lambda **kw: hf_forward(layer, **kw), 1)  # HF's forward over the same parts
    got, got_cache = probe.run(layer, 1)
    assert want.dtype == got.dtype == dtype
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)


def test_scaled_residuals_fail_the_probe(tiny_model) -> None:
    # Granite's layer is a Llama layer whose residual branches are scaled: every part fuses,
    # the layer itself does not
    model = _load(tiny_model("granite", head_dim=16, residual_multiplier=0.5))
    counts = fusion.fuse_model(model)
    assert counts["attention"] == counts["decoder_layer"] + 2 == 2 and counts["rejected"] == 2
    assert not any(isinstance(layer, FusedDecoderLayer) for layer in model.model.layers)


def test_the_layers_plain_attributes_stay_and_the_kind_can_be_left_out(tiny_model) -> None:
    model = _load(tiny_model("qwen2", head_dim=16))
    counts = fusion.fuse_model(model, kinds=("rms_norm", "gated_mlp", "attention"))
    assert counts["decoder_layer"] == 0 and counts["attention"] == 2
    assert fusion.fuse_model(model)["decoder_layer"] == 0  # no probe of an earlier call's layers
    model = _load(tiny_model("qwen2", head_dim=16))
    plain = {name: value for name, value in vars(model.model.layers[0]).items() if not name.startswith("_")
             and name != "training"}
    assert fusion.fuse_model(model)["decoder_layer"] == 2
    layer = model.model.layers[0]
    assert isinstance(layer, FusedDecoderLayer) and plain and all(getattr(layer, k) == v for k, v in plain.items())


def test_the_decoder_runs_the_engines_steps_by_its_lean_forward_with_hfs_bits(tiny_model) -> None:
    model = _load(tiny_model("llama", head_dim=16))
    assert fusion.fuse_model(model)["decoder"] == 1
    lean = model.model.forward
    assert isinstance(lean, LeanDecoderForward)
    probe = _all_prefill_probe(model, torch.float32)  # beyond the probe: another step
    ids = torch.tensor([[5, 9, 31, 77, 120]])
    got = fusion._decoder_probe_run(model, probe, ids)
    model.model.forward = lean.original
    want = fusion._decoder_probe_run(model, probe, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_decoder_forward_of_other_semantics_fails_the_probe(tiny_model, monkeypatch) -> None:
    model = _load(tiny_model("llama", head_dim=16))
    lean_call = LeanDecoderForward.__call__

    def skips_the_norm(self, **kwargs):
        norm = self.decoder.norm
        self.decoder.norm = torch.nn.Identity()
        try:
            return lean_call(self, **kwargs)
        finally:
            self.decoder.norm = norm
    monkeypatch.setattr(LeanDecoderForward, "__call__", skips_the_norm)
    counts = fusion.fuse_model(model)
    assert counts["decoder_layer"] == 2 and counts["decoder"] == 0 and counts["rejected"] == 1
    assert "forward" not in vars(model.model)
