"""The HF-folder architectures people run, tiny and random, against HF itself (fp32, CPU).

Llama, Mistral (a sliding window on every layer), Qwen2 (``use_sliding_window``: the layers from
``max_window_layers`` on slide), Qwen3 (per-head q/k norms), Gemma 2 (sliding layers alternating
with global ones, ``query_pre_attn_scalar``, attention and final logit soft-capping), Gemma 3
text (local and global layers with separate RoPE tables, q/k norms) and Phi-3 (fused qkv and
gate_up, a sliding window). The windows are 16 tokens and the prompts about three windows long,
so decodes, whole prefills, chunked prefills (a small step budget) and prefix hits (prompts that
share their first blocks) all attend across a window's edge, at block sizes 16 and 1.

The oracle is HF's eager attention: ``generate``'s greedy tokens one prompt at a time, and the
log-probabilities of a forward pass over prompt + generated tokens, which batchgen's sampled
tokens' logprobs must equal within 1e-5; the prompt logprobs (the scorer's path, through the
final soft cap) likewise; beam search gives HF's beams and ``loglikelihood`` HF's sum. Gemma 2 and 3 also run in bfloat16
and float16, every layer fused, against HF in the same dtype.
"""

from __future__ import annotations

import pytest
import torch
from hf_logprobs import hf_loglikelihood, loglikelihood_tolerance
from hf_oracles import hf_beam, hf_greedy

from batchgen import LLM, SamplingParams
from batchgen.sampling import BeamSearchParams

WINDOW = 16
MAX_TOKENS = 10
TOL = 1e-5

# model type -> config overrides (on conftest's tiny sizes: hidden 64, 4 heads, 2 KV heads)
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW, "head_dim": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0, "num_hidden_layers": 3},
    "gemma3_text": {"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 3,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "phi3": {"sliding_window": WINDOW, "pad_token_id": 0},
}


def _prompts(vocab: int) -> list[list[int]]:
    """Four prompts of about three windows; the last two share their first 32 tokens with the
    first (prefix hits at block size 16)."""
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(3, vocab, (55,), generator=gen).tolist()
    other = torch.randint(3, vocab, (50,), generator=gen).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (26, 21)]
    return [first, other, first[:32] + tails[0], first[:32] + tails[1]]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens) - 1]``: HF's logprob of token ``p`` given ``0 .. p-1`` (float32)."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request, shared_tiny_model):
    """(model type, path, prompts, HF greedy tokens, HF logprobs of prompt + generated)."""
    model_type = request.param
    path = shared_tiny_model(model_type, **ARCHITECTURES[model_type])
    model = _hf(path)
    prompts = _prompts(model.config.vocab_size)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    greedy = hf_greedy(model, prompts, MAX_TOKENS, eos_ids)
    logprobs = [_hf_logprobs(model, p + g) for p, g in zip(prompts, greedy)]
    return model_type, path, prompts, greedy, logprobs


@pytest.mark.parametrize("block_size", [16, 1])
def test_greedy_tokens_and_logprobs_equal_hf(arch, block_size: int) -> None:
    model_type, path, prompts, greedy, hf_lps = arch
    # a step budget of 24 tokens: the prompts prefill in chunks, beside other prompts' decodes
    llm = LLM(path, dtype="float32", block_size=block_size, max_num_batched_tokens=24)
    assert llm.runner.max_model_len >= 1024  # no cap at the window
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))
    for i, (out, want, lps) in enumerate(zip(outs, greedy, hf_lps)):
        got = out.outputs[0]
        assert got.token_ids == want, f"{model_type} prompt {i}: {got.token_ids} != HF {want}"
        ours = torch.tensor([entry[t] for entry, t in zip(got.logprobs, got.token_ids)])
        theirs = lps[len(prompts[i]) - 1:]
        gap = float((ours - theirs).abs().max())
        assert gap <= TOL, f"{model_type} prompt {i}: logprobs {gap:.2e} from HF's"


def test_prompt_logprobs_equal_hf(arch) -> None:
    # the scorer's path: hidden states through the output layer and the final soft cap
    model_type, path, prompts, _, hf_lps = arch
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24)
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    for i, out in enumerate(outs):
        ours = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompts[i][1:])])
        gap = float((ours - hf_lps[i][:len(prompts[i]) - 1]).abs().max())
        assert gap <= TOL, f"{model_type} prompt {i}: prompt logprobs {gap:.2e} from HF's"


def test_beam_search_and_loglikelihood_equal_hf(arch) -> None:
    # the other paths through the final logits (and Gemma's final soft cap): beam search's
    # beams, and lm-eval's loglikelihood over a continuation that crosses the window
    model_type, path, prompts, _, _ = arch
    model = _hf(path)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24)
    out = llm.generate([prompts[0]], BeamSearchParams(beam_width=3, max_tokens=8))[0]
    want, _ = hf_beam(model, prompts[0], 3, 1.0, False, 8, eos)
    assert [c.token_ids + ([eos] if c.finish_reason == "stop" else []) for c in out.outputs] == want, model_type
    context, continuation = prompts[1][:20], prompts[1][20:]
    (total, greedy), = llm.loglikelihood([(context, continuation)])
    want_total, want_greedy = hf_loglikelihood(model, context, continuation)
    assert abs(total - want_total) <= loglikelihood_tolerance(len(continuation)) and greedy == want_greedy, model_type


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_attention_backend_gives_hf_tokens(arch, backend: str) -> None:
    # the torch backend (SDPA, and HF's eager arithmetic for soft-capped layers) and the C
    # kernel, each with the torch linear layers (no fusion)
    model_type, path, prompts, greedy, _ = arch
    llm = LLM(path, dtype="float32", block_size=16, attention_backend=backend, linear_backend="torch")
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == greedy[:2], f"{model_type} on {backend}"


def _bytes_per_block(path: str) -> int:
    """The bytes of one float32 KV block of 16 tokens of the model at ``path``."""
    from transformers import AutoConfig

    from batchgen.engine.model_loader import cache_shape

    return cache_shape(AutoConfig.from_pretrained(path), 16, torch.float32).bytes_per_block


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_model_whose_every_layer_slides_releases_the_blocks_behind_its_window(arch, backend: str) -> None:
    # Mistral and Phi-3 here: a cache of 5 blocks of 16 (one the null block) where a prompt and
    # its 10 tokens need 4 or 5 blocks without the release; the four prompts (about three
    # windows each) preempt one another and still give HF's tokens, on either backend (the
    # torch one reads the released entries' null block, masked)
    model_type, path, prompts, greedy, _ = arch
    if model_type not in ("mistral", "phi3"):
        pytest.skip(f"{model_type} has a layer that sees the whole context: nothing is released")
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24, attention_backend=backend,
              kv_cache_memory=5 * _bytes_per_block(path))
    bm = llm.engine.block_manager
    assert llm.runner.num_blocks == 5 and bm.window == WINDOW and bm.num_usable_blocks == 4
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == greedy, model_type
    assert bm.num_released_blocks > 0 and bm.peak_blocks_used <= 4
    assert llm.stats().num_released_blocks == bm.num_released_blocks
    assert max(len(p) + len(g) for p, g in zip(prompts, greedy)) > 4 * 16  # more than the cache holds


def test_the_release_changes_no_sample_beam_or_prompt_logprob(arch, monkeypatch) -> None:
    # seeded n = 3 samples, beams of 3 and prompt logprobs in a 6-block cache (preemption,
    # prefix hits, forks over released entries) against the same engine keeping every block
    model_type, path, prompts, _, _ = arch
    if model_type != "mistral":
        pytest.skip("one model whose every layer slides is enough here")
    from batchgen.engine.model_runner import ModelRunner

    def run() -> tuple[tuple[list, list, list], int]:
        llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=24,
                  kv_cache_memory=6 * _bytes_per_block(path))
        samples = llm.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=0))
        beams = llm.generate(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=5))
        scored = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        outputs = ([[(c.token_ids, c.logprobs) for c in o.outputs] for o in samples],
                   [[c.token_ids for c in o.outputs] for o in beams], [o.prompt_logprobs for o in scored])
        return outputs, llm.stats().num_released_blocks

    released_outputs, released = run()
    monkeypatch.setattr(ModelRunner, "kv_window", property(lambda self: None))
    kept_outputs, kept = run()
    assert released > 0 and kept == 0
    assert released_outputs == kept_outputs


def test_windows_change_the_tokens_the_reference_would_give_without_them(arch) -> None:
    # the windows are real: with them removed HF's own logprobs move (so matching HF above
    # could not pass with full attention)
    model_type, path, prompts, greedy, hf_lps = arch
    if not ARCHITECTURES[model_type].get("sliding_window"):
        pytest.skip(f"{model_type} has no sliding window here")
    from transformers import AutoModelForCausalLM

    model = _hf(path)
    config = model.config
    config.sliding_window = 10_000
    full = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    moved = (_hf_logprobs(full, prompts[0] + greedy[0]) - hf_lps[0]).abs().max()
    assert float(moved) > 1e-3, f"{model_type}: the window does not change HF's logprobs"


def test_the_cpu_path_fuses_every_attention_layer_it_can(arch) -> None:
    # the runs above went through the fused attention: every layer (Phi-3's one qkv_proj
    # too), with each layer's window and soft cap as HF passes them; and every decoder layer
    # (Phi-3's with its dropouts around the residual adds, Gemma's with its norms around the
    # attention's and the MLP's outputs) by the lean decoder-layer forward
    from batchgen.engine.fused_attention import FusedAttention
    from batchgen.engine.fused_decoder import FusedDecoderLayer

    model_type, path, *_ = arch
    llm = LLM(path, dtype="float32", block_size=16)
    config = llm.runner.model.config
    layers = [layer.self_attn for layer in llm.runner.model.model.layers]
    fused = [isinstance(layer, FusedAttention) for layer in layers]
    assert fused == [True] * len(layers), model_type
    decoder_layers = llm.runner.model.model.layers
    assert all(type(layer) is FusedDecoderLayer for layer in decoder_layers), model_type
    assert {layer.form for layer in decoder_layers} == {"sandwich" if "gemma" in model_type else "pre_norm"}
    for i, layer in enumerate(layers):
        if isinstance(layer, FusedAttention):
            kinds = getattr(config, "layer_types", None)
            sliding = kinds[i] == "sliding_attention" if kinds else bool(getattr(config, "sliding_window", None))
            assert layer.options.sliding_window == (WINDOW if sliding else None), (model_type, i)
            assert layer.options.logits_soft_cap == getattr(config, "attn_logit_softcapping", None), (model_type, i)
            assert layer.qk_norms == (model_type in ("qwen3", "gemma3_text")), (model_type, i)


#: How far a 16-bit run's token logprobs may stand from HF's in the same dtype (its kernels sum
#: in other orders: measured 0.031 in bfloat16 and 0.004 in float16, fused layers or not).
HALF_TOL = {torch.bfloat16: 0.1, torch.float16: 0.02}


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def gemma(request, shared_tiny_model) -> tuple[str, list[list[int]]]:
    """(path, prompts) of a tiny Gemma 2 or Gemma 3 of ARCHITECTURES."""
    path = shared_tiny_model(request.param, **ARCHITECTURES[request.param])
    return path, _prompts(_hf(path).config.vocab_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_gemma_fuses_every_layer_and_stays_near_hf(gemma, dtype) -> None:
    """Gemma's ``1 + weight`` norms fuse in 16 bits too (their weight kept in float32), so every
    decoder layer runs the lean forward; greedy tokens are HF's (same dtype, eager) argmax and
    their logprobs within HALF_TOL of HF's."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.fused_decoder import FusedDecoderLayer
    from batchgen.engine.fused_layers import FusedRMSNorm

    path, prompts = gemma
    llm = LLM(path, dtype=str(dtype).removeprefix("torch."), block_size=16)
    assert all(type(layer) is FusedDecoderLayer for layer in llm.runner.model.model.layers)
    norms = [m for m in llm.runner.model.modules() if isinstance(m, FusedRMSNorm)]
    assert norms and {n.weight.dtype for n in norms} == {torch.float32}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, -1)
        assert want.argmax(-1).tolist() == tokens
        got = torch.tensor([out.outputs[0].logprobs[i][t] for i, t in enumerate(tokens)])
        torch.testing.assert_close(got, want.gather(1, torch.tensor(tokens)[:, None])[:, 0], rtol=0,
                                   atol=HALF_TOL[dtype])
