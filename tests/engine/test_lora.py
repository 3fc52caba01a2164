"""LoRA adapters in the engine, against HF + PEFT: greedy tokens equal, logprobs within 1e-5
(float32), on a tiny random llama; a batch mixing adapters and the base gives each row what it
gets alone, bit for bit; the prefix cache shares KV only within one adapter; adapters load
lazily into ``max_loras`` slots."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from batchgen import LLM, LoRARequest, SamplingParams  # noqa: E402

from hf_logprobs import hf_prompt_logprobs  # noqa: E402
from hf_oracles import hf_greedy  # noqa: E402
from lora_adapters import ALL, peft_model, save_adapter  # noqa: E402

PROMPTS = [[1, 5, 9, 200, 31, 7], [1, 44, 2, 90], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(shared_tiny_model, tmp_path_factory):
    """A tiny llama and three adapters: rank 8 on q/v; rank 16 on every projection with
    rsLoRA; rank 8 on o and the MLP."""
    path = shared_tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "qv8": save_adapter(path, root / "qv8", 8, ["q_proj", "v_proj"], seed=1),
        "all16rs": save_adapter(path, root / "all16rs", 16, ALL, rslora=True, seed=2),
        "mlp8": save_adapter(path, root / "mlp8", 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], seed=3),
    }
    return path, adapters


@pytest.fixture(scope="module")
def llm(tiny):
    path, _ = tiny
    return LLM(path, enable_lora=True, max_loras=4, max_lora_rank=16, block_size=4)


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(sorted(adapters.items()))}


def _greedy(logprobs: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=logprobs, ignore_eos=True)


@pytest.mark.parametrize("name", ["qv8", "all16rs", "mlp8"])
def test_greedy_tokens_and_logprobs_equal_peft(tiny, llm, name: str) -> None:
    path, adapters = tiny
    request = _requests(adapters)[name]
    _assert_equals_peft(path, adapters[name], llm.generate(PROMPTS, _greedy(), lora_request=request))


def _assert_equals_peft(path: str, adapter: str, outs: list) -> None:
    """``outs`` (greedy, logprobs 0, over :data:`PROMPTS`) are PEFT's tokens and logprobs with
    ``adapter``, which changes the base model's output."""
    model = peft_model(path, adapter)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, [-1])
    base = hf_greedy(peft_model(path, None), PROMPTS, MAX_TOKENS, [-1])
    assert want != base, "the adapter must change the output, or the test proves nothing"
    for prompt, out, tokens in zip(PROMPTS, outs, want):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == tokens
        ref = hf_prompt_logprobs(model, prompt + tokens, 0)[len(prompt) - 1:]
        got = [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)]
        for g, r in zip(got, ref):
            assert abs(g - r["logprob"]) < 1e-5


def test_a_mixed_batch_equals_each_adapter_alone_bitwise(tiny, llm) -> None:
    _, adapters = tiny
    requests = list(_requests(adapters).values()) + [None]
    alone = {}
    for request in requests:
        llm.reset_prefix_cache()
        alone[request] = llm.generate(PROMPTS, _greedy(3), lora_request=request)
    llm.reset_prefix_cache()
    prompts = [p for p in PROMPTS for _ in requests]
    loras = [r for _ in PROMPTS for r in requests]
    mixed = llm.generate(prompts, _greedy(3), lora_request=loras)
    for i, (out, request) in enumerate(zip(mixed, loras)):
        ref = alone[request][i // len(requests)].outputs[0]
        assert out.outputs[0].token_ids == ref.token_ids
        assert out.outputs[0].logprobs == ref.logprobs  # floats compared exactly
    distinct = {tuple(alone[r][0].outputs[0].token_ids) for r in requests}
    assert len(distinct) > 2, "the adapters must give different outputs, or the test proves nothing"


def test_prefix_cache_is_shared_only_within_one_adapter(tiny, llm) -> None:
    _, adapters = tiny
    a, b = list(_requests(adapters).values())[:2]
    prompt = list(range(1, 41))  # 10 full blocks of 4
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def prefilled(loras: list) -> tuple[int, list[int]]:
        llm.reset_prefix_cache()
        before = llm.stats().num_prefill_tokens
        outs = llm.generate([prompt, prompt], one, lora_request=loras)
        return llm.stats().num_prefill_tokens - before, [o.stats.num_cached_tokens for o in outs]

    assert prefilled([a, b]) == (2 * len(prompt), [0, 0])
    assert prefilled([a, None]) == (2 * len(prompt), [0, 0])
    computed, cached = prefilled([a, a])
    assert computed <= len(prompt) + 4 and cached[1] >= len(prompt) - 4


def test_adapters_load_lazily_and_evict_least_recently_used(tiny, llm) -> None:
    path, adapters = tiny
    requests = _requests(adapters)
    small = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=16, block_size=4)
    assert small.runner.lora.num_loads == 0
    order = ["qv8", "all16rs", "qv8", "mlp8"]
    outs = small.generate([PROMPTS[0]] * len(order), _greedy(), lora_request=[requests[n] for n in order])
    for name, out in zip(order, outs):
        want = llm.generate([PROMPTS[0]], _greedy(), lora_request=requests[name])[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    lora = small.runner.lora
    assert lora.num_loads >= 3 and lora.num_evictions >= 2 and len(lora.loaded) == 1


def test_scoring_with_adapters_equals_peft(tiny, llm) -> None:
    from hf_logprobs import hf_loglikelihood

    path, adapters = tiny
    request = _requests(adapters)["all16rs"]
    pairs = [([1, 5, 9, 200], [31, 7, 8]), ([1, 44], [2, 90, 91, 92])]
    got = llm.loglikelihood(pairs, lora_request=request)
    model = peft_model(path, adapters["all16rs"])
    for (context, continuation), (lp, greedy) in zip(pairs, got):
        want, want_greedy = hf_loglikelihood(model, context, continuation)
        assert abs(lp - want) < 1e-4 and greedy == want_greedy
    base = llm.loglikelihood(pairs)
    assert all(abs(x[0] - y[0]) > 1e-3 for x, y in zip(got, base))
    from batchgen.engine.loglikelihood import prefix_token_id

    text = list(range(1, 30))  # one window: every token given the prefix token and those before
    rolled = llm.loglikelihood_rolling([text], lora_request=[request])[0]
    want, _ = hf_loglikelihood(model, [prefix_token_id(llm.tokenizer)], text)
    assert abs(rolled - want) < 1e-4 * len(text)


def test_phi3_s_fused_projections_take_peft_s_adapters(shared_tiny_model, tmp_path_factory) -> None:
    """Phi-3's qkv_proj and gate_up_proj are single linears (fused layers of one part each in
    the engine): an adapter on them, o_proj and down_proj gives PEFT's greedy tokens and
    logprobs."""
    path = shared_tiny_model("phi3", pad_token_id=0)
    adapter = save_adapter(path, tmp_path_factory.mktemp("phi3_adapter") / "a",
                           8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=6)
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4)
    _assert_equals_peft(path, adapter, llm.generate(PROMPTS, _greedy(), lora_request=LoRARequest("phi3", 1, adapter)))


def test_gemma2_s_fused_sandwich_layers_take_peft_s_adapters(shared_tiny_model, tmp_path_factory) -> None:
    """Gemma 2's layers fuse (its 1 + w norms, GELU-tanh MLP, soft caps, the sandwich layer): an
    adapter on every projection, q/k/v and gate/up inside the merged linears, gives PEFT's
    greedy tokens and logprobs."""
    path = shared_tiny_model("gemma2", head_dim=16, num_hidden_layers=2, attn_logit_softcapping=2.0,
                             final_logit_softcapping=8.0, query_pre_attn_scalar=24)
    adapter = save_adapter(path, tmp_path_factory.mktemp("gemma2_adapter") / "a", 8,
                           ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=7)
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4)
    assert {type(layer).__name__ for layer in llm.runner.model.model.layers} == {"FusedDecoderLayer"}
    _assert_equals_peft(path, adapter, llm.generate(PROMPTS, _greedy(), lora_request=LoRARequest("gemma2", 1, adapter)))
