"""Greedy output equals HF transformers ``generate`` token for token (fp32, CPU).

The oracle is HF's own ``model.generate(do_sample=False)`` run one prompt at a time (no
padding), on the real SmolLM2-135M-Instruct and on tiny random qwen2 / mistral / llama models.
batchgen runs all prompts together in one batch, under every cache configuration that changes
the path a token takes: block sizes, preemption by recompute, chunked prefill, prefix hits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracles import hf_greedy

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import compiler as cpu_compiler

pytestmark = pytest.mark.slow

W32 = Path(__file__).resolve().parents[2] / "bench" / "w32.jsonl"
MAX_TOKENS = 64
LONG_TOPICS = [
    "the water cycle", "how vaccines train the immune system", "the causes of the first world war",
    "how a compiler turns source code into machine code",
]


def _w32_prompts() -> list[list[int]]:
    if not W32.is_file():
        shared = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "w32.jsonl"
        path = shared
    else:
        path = W32
    return [json.loads(line)["prompt_token_ids"] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """24 chat prompts of 20 to 300 tokens: 20 from W32 plus 4 long ones."""
    ids = _w32_prompts()[:20]
    for topic in LONG_TOPICS:
        detail = (f"Explain {topic} step by step. Cover the history, the key ideas, a worked "
                  "example, common misconceptions, and what is still debated today. ") * 5
        text = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": detail}], tokenize=False, add_generation_prompt=True)
        ids.append(smollm2_tokenizer(text)["input_ids"][:300])
    lengths = [len(p) for p in ids]
    assert min(lengths) >= 20 and max(lengths) >= 200 and max(lengths) <= 300, lengths
    return ids


@pytest.fixture(scope="module")
def hf_reference(smollm2_path, prompts, oracle_cache, hf_map) -> list[list[int]]:
    """HF's greedy tokens for every prompt, computed once for all the cases of this module."""
    from transformers import AutoModelForCausalLM

    def compute() -> list[list[int]]:
        model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos)
        return hf_map(lambda p: hf_greedy(model, [p], MAX_TOKENS, eos_ids)[0], prompts)

    weights = Path(smollm2_path, "model.safetensors").stat().st_size
    return oracle_cache(["greedy", weights, prompts, MAX_TOKENS], compute)


def _run(path: str, prompts, **engine_kwargs):
    llm = LLM(path, dtype="float32", **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return llm, [o.outputs[0].token_ids for o in outs]


def _assert_same(ours: list[list[int]], ref: list[list[int]]) -> None:
    mismatches = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ, e.g. ours {ours[mismatches[0]][:16]} vs HF {ref[mismatches[0]][:16]}"
    assert len(ours) == len(ref)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_greedy_equals_hf_for_block_sizes(smollm2_path, prompts, hf_reference, block_size):
    llm, ours = _run(smollm2_path, prompts, block_size=block_size, kv_cache_memory=256 * 2**20)
    # The default on a CPU is the compiled kernel, when there is a compiler to build it.
    assert llm.runner.attention_backend == ("cpu" if cpu_compiler() else "torch")
    _assert_same(ours, hf_reference)
    stats = llm.stats()
    assert stats.num_preemptions == 0
    # Every block went back: nothing leaks across requests.
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_greedy_equals_hf_on_the_torch_backend(smollm2_path, prompts, hf_reference):
    """The portable backend (no C compiler, or non-float32 dtypes) gives the same tokens."""
    llm, ours = _run(smollm2_path, prompts, block_size=16, attention_backend="torch")
    assert llm.runner.attention_backend == "torch"
    _assert_same(ours, hf_reference)


def test_greedy_equals_hf_on_the_cpu_linear_backend_at_one_and_two_threads(smollm2_path, prompts, hf_reference):
    """batchgen's own GEMM for every linear layer (the default wherever it builds) sums in
    another order than MKL; the tokens stay HF's, at one thread and at two."""
    from batchgen.kernels.cpu.linear import PackedLinear, unsupported_reason

    why = unsupported_reason(torch.float32, torch.device("cpu"))
    if why is not None:
        pytest.skip(f"the CPU linear kernel cannot run here: {why}")
    for threads in (1, 2):
        llm, ours = _run(smollm2_path, prompts, block_size=16, num_threads=threads)
        assert llm.runner.linear_backend == "cpu" and llm.runner.threads.kernels == threads
        assert isinstance(llm.runner.model.lm_head, PackedLinear)
        _assert_same(ours, hf_reference)


def test_greedy_equals_hf_on_the_torch_linear_backend(smollm2_path, prompts, hf_reference):
    """torch's linear layers (where the C kernels cannot run) give the same tokens."""
    llm, ours = _run(smollm2_path, prompts, block_size=16, linear_backend="torch")
    assert llm.runner.linear_backend == "torch"
    _assert_same(ours, hf_reference)


def test_greedy_equals_hf_under_preemption(smollm2_path, prompts, hf_reference):
    # ~1,100 token slots for 24 sequences that grow to ~4,000 tokens: preemption must happen.
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    llm, ours = _run(smollm2_path, prompts, block_size=16, kv_cache_memory=1100 * bytes_per_token)
    assert llm.stats().num_preemptions > 0, "the budget was meant to force preemption"
    _assert_same(ours, hf_reference)


def test_greedy_equals_hf_with_chunked_prefill(smollm2_path, prompts, hf_reference):
    budget = 48
    assert max(len(p) for p in prompts) > 4 * budget  # long prompts take several chunks
    llm, ours = _run(smollm2_path, prompts, block_size=16, max_num_batched_tokens=budget,
                     enable_prefix_caching=False)
    _assert_same(ours, hf_reference)
    stats = llm.stats()
    assert stats.num_prefill_tokens == sum(len(p) for p in prompts)  # every prompt token once
    assert stats.num_steps > sum(len(p) for p in prompts) // budget


def test_greedy_equals_hf_with_prefix_cache_hits(smollm2_path, prompts, hf_reference):
    # Two waves of 12 sequences: the second finds the shared system prompt's blocks cached.
    llm, ours = _run(smollm2_path, prompts, block_size=8, max_num_seqs=12, enable_prefix_caching=True)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_prefill_tokens < sum(len(p) for p in prompts)
    _assert_same(ours, hf_reference)


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen2", {}),
    ("mistral", {"sliding_window": 512}),
    ("llama", {"num_key_value_heads": 1}),  # MQA
])
def test_greedy_equals_hf_on_tiny_random_models(tiny_model, smollm2_tokenizer, model_type, overrides):
    from transformers import AutoModelForCausalLM

    path = tiny_model(model_type, **overrides)
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate([7, 23, 40, 61, 100, 5])]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = smollm2_tokenizer.eos_token_id
    ref = hf_greedy(model, prompts, 24, [eos])
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    _assert_same([o.outputs[0].token_ids for o in outs], ref)
