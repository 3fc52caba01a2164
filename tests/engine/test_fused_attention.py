"""The fused attention layer of the CPU path (``engine/fused_attention.py``, fused by
``engine/fusion.py``).

On the real SmolLM2 every one of its 30 attention layers is fused, and a run with them fused
gives the tokens and log-probabilities of the run without (same C GEMM, attention backend and
cache), bit for bit, over decode, prefill and mixed steps, in float32 and bfloat16. Qwen3's
per-head q/k norms are run by the fused layer and pass the probe; layers of other semantics must
fail the probe and stay: a Llama whose RoPE is the interleaved kind.
A machine where the C ops cannot be built skips with that reason.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine import fusion, paged_attention
from batchgen.engine.fused_attention import FusedAttention
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_fused.available() or cpu_linear.unsupported_reason(torch.float32, torch.device("cpu")) is not None,
    reason="the CPU linear kernel or the fused CPU ops cannot be built here")

W32 = Path(__file__).resolve().parents[2] / "bench" / "w32.jsonl"


def _generate(path: str, prompts: list[list[int]], fuse: bool, dtype: str) -> tuple[LLM, list]:
    with pytest.MonkeyPatch.context() as mp:
        if not fuse:
            without_attention = functools.partial(fusion.fuse_model, kinds=("rms_norm", "gated_mlp"))
            mp.setattr(fusion, "fuse_model", without_attention)
        # a small step budget: prompts prefill in chunks beside other sequences' decodes
        llm = LLM(path, dtype=dtype, linear_backend="cpu", block_size=16, max_num_batched_tokens=96)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=1))
    return llm, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def smollm2_runs(smollm2_path, request):
    prompts = [json.loads(line)["prompt_token_ids"] for line in W32.read_text().splitlines()[:8]]
    fused_llm, fused = _generate(smollm2_path, prompts, fuse=True, dtype=request.param)
    layers = [type(layer.self_attn) for layer in fused_llm.runner.model.model.layers]
    del fused_llm
    _, unfused = _generate(smollm2_path, prompts, fuse=False, dtype=request.param)
    return layers, fused, unfused


def test_every_smollm2_attention_layer_is_fused(smollm2_runs) -> None:
    layers, _, _ = smollm2_runs
    assert len(layers) == 30 and all(t is FusedAttention for t in layers)


def test_fused_attention_gives_the_unfused_tokens_and_logprobs_bit_for_bit(smollm2_runs) -> None:
    _, fused, unfused = smollm2_runs
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert all(len(o.token_ids) > 4 for o in fused)
    assert [o.cumulative_logprob for o in fused] == [o.cumulative_logprob for o in unfused]
    assert [o.logprobs for o in fused] == [o.logprobs for o in unfused]


def _fuse_attention_only(model: torch.nn.Module) -> dict[str, int]:
    """The attention fusion alone: ``{"attention": fused, "rejected": left}``."""
    counts = fusion.fuse_model(model, kinds=("attention",))
    assert counts["rms_norm"] == counts["gated_mlp"] == 0
    return {"attention": counts["attention"], "rejected": counts["rejected"]}


def _load(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=paged_attention.register()).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_llama_is_fused_and_its_layer_reproduces_the_original(tiny_model, dtype) -> None:
    model = _load(tiny_model("llama", head_dim=16), dtype)
    original = model.model.layers[1].self_attn
    counts = _fuse_attention_only(model)
    assert counts == {"attention": 2, "rejected": 0}
    fused = model.model.layers[1].self_attn
    assert isinstance(fused, FusedAttention) and fused.num_heads == 4 and fused.num_kv_heads == 2
    # beyond the probe: another step (all decodes), in the model's own call
    probe = fusion._Probe(fusion._rotary_embedding(model), 64, 2, 2, 16, dtype)
    probe.meta.num_decode_tokens = 0
    probe.meta.prefill_block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    probe.meta.prefill_query_start_loc = torch.tensor([0, 1, 5], dtype=torch.int32)
    probe.meta.prefill_context_lens = torch.tensor([6, 6], dtype=torch.int32)
    (want, none), want_cache = probe.run(original, 1)
    (got, _), got_cache = probe.run(fused, 1)
    assert none is None
    tol = fusion.PROBE_TOL[dtype] * float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= tol
    assert float((got_cache.float() - want_cache.float()).abs().max()) <= tol


def test_qwen3_q_and_k_norms_are_fused(tiny_model) -> None:
    model = _load(tiny_model("qwen3", head_dim=16))
    assert hasattr(model.model.layers[0].self_attn, "q_norm")
    assert _fuse_attention_only(model) == {"attention": 2, "rejected": 0}
    assert all(isinstance(layer.self_attn, FusedAttention) and layer.self_attn.qk_norms
               for layer in model.model.layers)


@pytest.mark.parametrize("model_type, overrides", [
    ("qwen3", {"head_dim": 16}),
    ("gemma3_text", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    ("gemma2", {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 2.0}),
])
def test_q_k_norms_windows_and_soft_caps_fused_give_the_unfused_bits(tiny_model, model_type, overrides) -> None:
    # per-head q/k norms, local and global RoPE tables, windows (crossed by 40-token prompts)
    # and soft caps: fused, the tokens and logprobs of the unfused run, bit for bit
    path = tiny_model(model_type, **overrides)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (40, 23)]
    fused_llm, fused = _generate(path, prompts, fuse=True, dtype="float32")
    assert all(type(layer.self_attn) is FusedAttention for layer in fused_llm.runner.model.model.layers)
    _, unfused = _generate(path, prompts, fuse=False, dtype="float32")
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert [o.logprobs for o in fused] == [o.logprobs for o in unfused]


def test_q_and_k_norms_left_out_fail_the_probe(tiny_model, monkeypatch) -> None:
    # the probe rule still holds: a fused layer that skipped Qwen3's norms would not pass
    model = _load(tiny_model("qwen3", head_dim=16))
    monkeypatch.setattr(FusedAttention, "_norm_heads", lambda self, qkv, num_tokens: None)
    assert _fuse_attention_only(model) == {"attention": 0, "rejected": 2}


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J style RoPE: pairs (x0, x1), (x2, x3), ... rotated, not the two halves."""
    cos = cos.unsqueeze(unsqueeze_dim)[..., : cos.shape[-1] // 2].repeat_interleave(2, -1)
    sin = sin.unsqueeze(unsqueeze_dim)[..., : sin.shape[-1] // 2].repeat_interleave(2, -1)

    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_another_rotary_fails_the_probe(tiny_model, monkeypatch) -> None:
    from transformers.models.llama import modeling_llama

    model = _load(tiny_model("llama", head_dim=16))
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _interleaved_rope)
    assert _fuse_attention_only(model) == {"attention": 0, "rejected": 2}
    assert isinstance(model.model.layers[0].self_attn, modeling_llama.LlamaAttention)


def test_fused_attention_needs_the_engine(tiny_model) -> None:
    model = _load(tiny_model("llama", head_dim=16))
    _fuse_attention_only(model)
    layer = model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="only inside the batchgen engine"):
        layer(hidden_states=torch.zeros(1, 2, 64), position_embeddings=None)


@pytest.mark.parametrize("model_type, fused, left", [("llama", 2, 0), ("qwen3", 2, 0)])
def test_the_runner_fuses_and_logs_the_count(tiny_model, caplog, model_type, fused, left) -> None:
    import logging

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.llm import load_runner

    with caplog.at_level(logging.INFO, logger="batchgen.engine.model_loader"):
        runner = load_runner(EngineConfig(model=tiny_model(model_type, head_dim=16), dtype="float32", device="cpu",
                             kv_cache_memory=2**20))
    assert f"{fused} attention layers and {fused} decoder layers ({left} candidates left as they were)" in caplog.text
    kinds = [type(layer.self_attn) is FusedAttention for layer in runner.model.model.layers]
    assert kinds == [fused > 0] * 2
