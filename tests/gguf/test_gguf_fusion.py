"""The CPU path's fusion over GGUF's quantized layers (``quantization="gguf"``): q/k/v and
gate/up merged by ``engine/fused_layers.merge_linears``, the layers fused by
``engine/fusion.fuse_model``.

A quantized layer's output column depends only on its weight row and the input row (the input
is quantized to int8 per row and block), so merged layers give the separate layers' bits: one
``QuantizedLinear.concat`` where the layers share a block type, a ``ConcatLinear`` over the runs
where they do not (a Q4_K_M file's Q6_K attn_v). Pinned here on single layers and on whole
tiny random Llamas run by the engine (one type throughout; Q4_K beside Q6_K): greedy tokens and
logprobs with the layers merged equal those with each layer run on its own, and with the
attention fused equal those of HF's attention, bit for bit, in float32 and bfloat16. The one
op of the fusion that is not bit-exact is the MLP's SiLU·up (float32 rounding, as on any model):
against HF's MLP the tokens are the same and the logprobs within 1e-5.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tiny_gguf import encode, write_llama_gguf

from batchgen.engine import fusion
from batchgen.engine.fused_attention import FusedAttention
from batchgen.engine.fused_layers import ConcatLinear, FusedGatedMLP, merge_linears, mergeable
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu import quant
from batchgen.kernels.cpu.linear import PackedLinear
from batchgen.kernels.cpu.quant import QuantizedLinear

pytestmark = pytest.mark.skipif(
    not cpu_fused.available() or quant.unsupported_reason() is not None
    or cpu_linear.unsupported_reason(torch.float32, torch.device("cpu")) is not None,
    reason="the fused CPU ops, the quantized kernel or the CPU linear kernel cannot be built here")

#: (every projection's type, overrides by tensor name): one type throughout, and Q4_K with
#: Q6_K attn_v and ffn_up (as Q4_K_M files mix them; here up too, so that gate/up mix).
FILES = {"Q8_0": ("Q8_0", {}), "Q4_K+Q6_K": ("Q4_K", {"attn_v": "Q6_K", "ffn_up": "Q6_K"})}


def _quantized(qtype: str, out_features: int, in_features: int, seed: int, bias: bool = False) -> QuantizedLinear:
    rng = np.random.default_rng(seed)
    weight = rng.normal(0.0, 0.05, size=(out_features, in_features)).astype(np.float32)
    stored, gguf_type = encode(weight, qtype, rng)
    b = torch.from_numpy(rng.normal(0.0, 0.1, size=out_features).astype(np.float32)) if bias else None
    return QuantizedLinear(stored, gguf_type, out_features, in_features, b)


@pytest.mark.parametrize("types, num_runs", [(("Q8_0", "Q8_0", "Q8_0"), 1), (("Q4_1", "Q4_1", "Q4_1"), 1),
                                             (("Q4_K", "Q4_K", "Q6_K"), 2), (("Q6_K", "Q4_K", "Q6_K"), 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_quantized_layers_give_the_separate_layers_bits(types, num_runs, dtype) -> None:
    """q/k/v-shaped layers (GQA widths, with biases) merged: one QuantizedLinear per run of one
    type; outputs equal the separate layers' concatenated, bit for bit, at 1 to 33 rows."""
    layers = [_quantized(t, width, 256, seed, bias=True) for seed, (t, width) in enumerate(zip(types, (256, 64, 64)))]
    assert mergeable(layers, dtype)
    merged = merge_linears(layers)
    if num_runs == 1:
        assert isinstance(merged, QuantizedLinear) and merged.qtype.name == types[0]
    else:
        assert isinstance(merged, ConcatLinear) and len(merged.parts) == num_runs
    assert merged.out_features == 384
    for rows in (1, 5, 33):
        x = (torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
        got = merged(x)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, torch.cat([layer(x) for layer in layers], dim=-1))


def test_a_float_layer_beside_quantized_ones_is_a_run_of_its_own() -> None:
    """A weight de-quantized at load (an F16 attn_v) is an ``nn.Linear`` among QuantizedLinear
    layers: it is packed on its own, and the outputs still equal the separate layers'."""
    q, k = _quantized("Q8_0", 64, 256, 0), _quantized("Q8_0", 32, 256, 1)
    torch.manual_seed(2)
    v = torch.nn.Linear(256, 32, bias=False)
    v_alone = PackedLinear(v)
    merged = merge_linears([q, k, v])
    assert isinstance(merged, ConcatLinear) and [type(p) for p in merged.parts] == [QuantizedLinear, PackedLinear]
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(merged(x), torch.cat([q(x), k(x), v_alone(x)], dim=-1))


VARIANTS = {  # name: (fusion kinds, whether linears merge)
    "fused": (fusion.KINDS, True),
    "unmerged": (fusion.KINDS, False),       # the same fused layers, each linear run on its own
    "hf_attention": (("rms_norm", "gated_mlp"), True),
    "norms_only": (("rms_norm",), True),     # the fusion before QuantizedLinear layers were fused
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """``runs(file, dtype, variant)``: (the first layer's q/k/v and MLP modules, the outputs of
    six greedy requests), each run once per module."""
    from batchgen import LLM, SamplingParams
    from batchgen.engine import fused_layers

    folder = tmp_path_factory.mktemp("fusion")
    done: dict[tuple[str, str, str], tuple] = {}

    def run(name: str, dtype: str, variant: str) -> tuple:
        if (name, dtype, variant) in done:
            return done[name, dtype, variant]
        path = folder / f"tiny-{name}.gguf"
        if not path.exists():
            linear_type, types = FILES[name]
            write_llama_gguf(path, linear_type=linear_type, types=types, embed_type="Q8_0")
        kinds, merge = VARIANTS[variant]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BATCHGEN_CACHE_DIR", str(folder / "cache"))
            mp.setattr(fusion, "fuse_model", functools.partial(fusion.fuse_model, kinds=kinds))
            if not merge:  # every layer a run of its own kind: a ConcatLinear of the layers as loaded
                mp.setattr(fused_layers, "_kind", id)
            # a small step budget: prompts prefill in chunks beside other sequences' decodes
            llm = LLM(str(path), quantization="gguf", dtype=dtype, linear_backend="cpu", block_size=16,
                      max_num_batched_tokens=48, kv_cache_memory=8 * 2**20)
        layer = llm.runner.model.model.layers[0]
        qkv = getattr(layer.self_attn, "qkv_proj", None)
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 23, 40, 9, 31, 17)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True))
        done[name, dtype, variant] = (qkv, layer.mlp), [o.outputs[0] for o in outs]
        return done[name, dtype, variant]

    return run


def _same_bits(a: list, b: list) -> None:
    assert all(len(o.token_ids) == 20 for o in a)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.cumulative_logprob for o in a] == [o.cumulative_logprob for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FILES))
def test_merged_layers_give_the_separate_layers_tokens_and_logprobs(runs, name: str, dtype: str) -> None:
    """The model fused with q/k/v and gate/up merged, and fused with every linear run on its
    own: the same tokens and logprobs, bit for bit."""
    (qkv, mlp), merged = runs(name, dtype, "fused")
    (qkv_alone, _), alone = runs(name, dtype, "unmerged")
    assert isinstance(mlp, FusedGatedMLP)
    if name == "Q8_0":
        assert isinstance(qkv, QuantizedLinear) and isinstance(mlp.gate_up_proj, QuantizedLinear)
    else:  # Q4_K q and k as one layer, the Q6_K v beside them; Q4_K gate beside Q6_K up
        assert [p.qtype.name for p in qkv.parts] == ["Q4_K", "Q6_K"] and qkv.parts[0].out_features == 256 + 128
        assert [p.qtype.name for p in mlp.gate_up_proj.parts] == ["Q4_K", "Q6_K"]
    assert isinstance(qkv_alone, ConcatLinear) and len(qkv_alone.parts) == 3
    _same_bits(merged, alone)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FILES))
def test_fused_attention_gives_hf_attentions_tokens_and_logprobs(runs, name: str, dtype: str) -> None:
    """Quantized q/k/v/o: FusedAttention (merged q/k/v, RoPE and the cache write in C) against
    HF's attention layer on the same layers, bit for bit."""
    (qkv, _), fused = runs(name, dtype, "fused")
    (none, _), hf = runs(name, dtype, "hf_attention")
    assert qkv is not None and none is None  # HF's LlamaAttention has no qkv_proj
    _same_bits(fused, hf)


@pytest.mark.parametrize("name", list(FILES))
def test_the_fused_mlp_stays_within_rounding_of_hf_mlp(runs, name: str) -> None:
    """The gated MLP's SiLU·up in C differs from torch's by float32 rounding (a polynomial
    ``exp``), which the down projection's int8 rounding of its input now and then turns into
    one quantization step: against the fusion of norms alone, the same greedy tokens and
    logprobs within 1e-5."""
    (_, mlp), fused = runs(name, "float32", "fused")
    (_, hf_mlp), before = runs(name, "float32", "norms_only")
    assert type(hf_mlp).__name__ == "LlamaMLP"
    assert [o.token_ids for o in fused] == [o.token_ids for o in before]
    for a, b in zip(fused, before):
        for got, want in zip(a.logprobs, b.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) <= 1e-5 for t in got)
