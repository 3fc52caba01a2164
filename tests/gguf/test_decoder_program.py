"""The decoder program (``engine/decoder_program.py``, ``kernels/cpu/decoder.c``): a decode
step's layers in one C call, calling the kernels the fused Python layers call, in their order.

Pinned: with the program and without it (the same engine, its ``program`` set aside), greedy
tokens, logprobs and cumulative logprobs are equal bit for bit, on tiny random Llamas in GGUF
blocks (Q8_0 throughout; Q4_K with Q6_K attn_v and ffn_up, so that q/k/v and gate/up are
ConcatLinears of two kinds), on Qwen3, Gemma 2, Gemma 3 and Phi-3 files in Q4_K and on HF Llama, Qwen2 (biases), Mistral (a sliding window), Phi-3
(fused q/k/v and gate/up), Gemma 2 and Gemma 3 (sandwich norms, GELU-tanh, soft caps, two RoPE
tables) in float32, Qwen3 (per-head q/k norms) in float32 and bfloat16, Llama and Gemma 2 in
bfloat16, and Qwen2 and Gemma 3 in float16; the program really ran the decode
steps; it is not installed where it cannot run a layer as Python does (LoRA, the torch
attention backend); a kernel's refusal reaches the caller as the Python layer's error would.
"""

from __future__ import annotations

import pytest
import torch

from tiny_arch import write_arch_gguf
from tiny_gguf import write_llama_gguf

from batchgen import LLM, SamplingParams
from batchgen.engine.decoder_program import DecoderProgram
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu import quant

pytestmark = pytest.mark.skipif(
    not cpu_fused.available() or quant.unsupported_reason() is not None
    or cpu_linear.unsupported_reason(torch.float32, torch.device("cpu")) is not None,
    reason="the fused CPU ops, the quantized kernel or the CPU linear kernel cannot be built here")

FILES = {"Q8_0": ("Q8_0", {}), "Q4_K+Q6_K": ("Q4_K", {"attn_v": "Q6_K", "ffn_up": "Q6_K"})}


def _outputs(llm: LLM) -> list:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 23, 40, 9, 31, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.outputs[0].logprobs) for o in outs]


def _with_and_without(llm: LLM, monkeypatch) -> None:
    forward = llm.runner.model.model.forward
    program = forward.program
    assert isinstance(program, DecoderProgram)
    steps = []
    run = program.run
    monkeypatch.setattr(program, "run", lambda hidden, *a: (steps.append(hidden.shape[-2]), run(hidden, *a))[1])
    with_program = _outputs(llm)
    assert steps and max(steps) > 1  # decode steps of several rows went through it
    forward.program = None
    try:
        without = _outputs(llm)
    finally:
        forward.program = program
    assert all(len(tokens) == 16 for tokens, _, _ in with_program)
    assert with_program == without


@pytest.mark.parametrize("name", list(FILES))
def test_the_program_gives_the_python_layers_bits_on_gguf_blocks(name, tmp_path, monkeypatch) -> None:
    linear_type, types = FILES[name]
    path = tmp_path / f"tiny-{name}.gguf"
    write_llama_gguf(path, linear_type=linear_type, types=types, embed_type="Q8_0", oracle=False)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    # a small step budget: prompts prefill in chunks beside other sequences' decodes
    llm = LLM(str(path), quantization="gguf", linear_backend="cpu", block_size=16, max_num_batched_tokens=48,
              kv_cache_memory=8 * 2**20)
    _with_and_without(llm, monkeypatch)


@pytest.mark.parametrize("case", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_the_program_gives_the_python_layers_bits_on_other_architectures_gguf(case, tmp_path, monkeypatch) -> None:
    """Files as llama.cpp's converter writes them (``tiny_arch``), in Q4_K: Qwen3's q/k norms,
    Gemma 2's and 3's sandwich norms (stored as 1 + w), GELU-tanh, soft caps and windows, Gemma
    3's two RoPE tables, Phi-3's fused q/k/v and gate/up; every layer fused and run by the
    program."""
    path = tmp_path / f"{case}-Q4_K.gguf"
    write_arch_gguf(path, case, "Q4_K")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(str(path), quantization="gguf", linear_backend="cpu", block_size=16, max_num_batched_tokens=48,
              kv_cache_memory=16 * 2**20)
    _with_and_without(llm, monkeypatch)


@pytest.mark.parametrize("model_type, overrides, dtype", [
    ("llama", {}, "float32"), ("qwen2", {}, "float32"), ("mistral", {"sliding_window": 8}, "float32"),
    ("qwen3", {}, "float32"), ("phi3", {"pad_token_id": 0}, "float32"), ("llama", {}, "bfloat16"),
    ("qwen2", {}, "float16"), ("qwen3", {}, "bfloat16"),
    ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 8.0, "num_hidden_layers": 3}, "float32"),
    ("gemma3_text", {"sliding_window": 8, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}, "float32"),
    ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 8.0, "num_hidden_layers": 3}, "bfloat16"),
    ("gemma3_text", {"sliding_window": 8, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}, "float16")])
def test_the_program_gives_the_python_layers_bits_on_a_float_model(tiny_model, model_type, overrides, dtype,
                                                                   monkeypatch) -> None:
    """Llama; Qwen2 (q/k/v biases); Mistral with a window shorter than the prompts; Qwen3 (per-head
    q/k norms); Phi-3 (one qkv_proj, one gate_up_proj, dropouts around the residual adds); Gemma 2
    (the sandwich norms as ``1 + w``, GELU-tanh, soft caps, alternating windows) and Gemma 3
    (q/k norms, local and global RoPE tables); 16-bit rows (their norms, SiLU·up and residual
    adds rounded as torch rounds them; a 16-bit Gemma's norms with their float32 ``1 + w``)."""
    if dtype != "float32" and not cpu_fused.load_fused().batchgen_fused_has_16():
        pytest.skip("this build of the fused ops has no 16-bit entry points (no AVX2 and F16C)")
    llm = LLM(tiny_model(model_type, head_dim=16, **overrides), linear_backend="cpu", block_size=16,
              kv_cache_memory=8 * 2**20, dtype=dtype)
    _with_and_without(llm, monkeypatch)


@pytest.mark.parametrize("model_type, settings", [("llama", {"enable_lora": True}),
                                                  ("llama", {"attention_backend": "torch"})])
def test_no_program_where_it_cannot_run_a_layer_as_python_does(tiny_model, model_type, settings) -> None:
    llm = LLM(tiny_model(model_type, head_dim=16), linear_backend="cpu", kv_cache_memory=8 * 2**20, **settings)
    assert getattr(llm.runner.model.model.forward, "program", None) is None
    out = llm.generate([[5, 9, 31]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_kernels_refusal_names_the_layer_and_the_kernel(tiny_model, monkeypatch) -> None:
    llm = LLM(tiny_model("llama", head_dim=16), linear_backend="cpu", block_size=16, kv_cache_memory=8 * 2**20)
    program = llm.runner.model.model.forward.program
    run = program.run

    def bad_slot(hidden, tables, meta):
        meta.slot_mapping.fill_(10**9)  # outside the cache
        return run(hidden, tables, meta)

    monkeypatch.setattr(program, "run", bad_slot)
    with pytest.raises(Exception) as caught:
        llm.generate([[5, 9, 31]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert "decoder layer 0: RoPE and the cache write refused its arguments: slots must lie in [0, " in str(caught.value)
