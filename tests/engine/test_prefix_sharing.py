"""A prompt prefix shared by a whole batch is computed once, even when its rows arrive together.

The real SmolLM2-135M-Instruct in fp32: 16 few-shot rows (one shared prefix of example
questions, then each row's own question) are all queued before the first step. With prefix
caching the first row computes the prefix and the others reuse its blocks from that same step
on, so the prompt tokens computed are at most the prefix, plus every row's own tokens, plus
one partial block per row. The outputs equal those of an engine without prefix caching
(greedy, seeded sampling, n = 4 samples and beams, the last two under a KV budget that forces
preemption and eviction), and HF ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracles import hf_beam, hf_greedy

from batchgen import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 6
BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V of 3 heads of 64, fp32
SHOTS = {
    "capitals": [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"),
                 ("Canada", "Ottawa")],
    "colours": [("grass", "green"), ("snow", "white"), ("the sky", "blue"), ("coal", "black")],
    "sums": [("2 + 3", "5"), ("7 + 1", "8"), ("4 + 4", "8"), ("6 + 3", "9")],
}
QUESTIONS = {
    "capitals": ["Germany", "Spain", "Kenya", "Peru", "Norway", "India", "Chile", "Greece",
                 "Cuba", "Nepal", "Poland", "Ghana", "Iran", "Austria", "Mexico", "Sweden"],
    "colours": ["a banana", "blood", "a carrot", "milk"],
    "sums": ["5 + 2", "1 + 1", "3 + 6", "2 + 2"],
}
ASK = {"capitals": "Q: What is the capital of {}?\nA:", "colours": "Q: What colour is {}?\nA:",
       "sums": "Q: What is {}?\nA:"}


def _prefix(tok, topic: str) -> list[int]:
    text = "Answer in one word.\n" + "".join(ASK[topic].format(q) + f" {a}\n" for q, a in SHOTS[topic])
    return tok(text, add_special_tokens=False)["input_ids"]


def _rows(tok, topic: str) -> tuple[list[int], list[list[int]]]:
    """(the shared prefix, each row's own tokens) of one topic."""
    return _prefix(tok, topic), [tok(ASK[topic].format(q), add_special_tokens=False)["input_ids"]
                                 for q in QUESTIONS[topic]]


@pytest.fixture(scope="module")
def batch(smollm2_tokenizer) -> tuple[list[int], list[list[int]]]:
    prefix, own = _rows(smollm2_tokenizer, "capitals")
    assert len(own) == 16 and len(prefix) > 4 * BLOCK
    return prefix, own


@pytest.fixture(scope="module")
def prompts(batch) -> list[list[int]]:
    prefix, own = batch
    return [prefix + o for o in own]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread: these forwards are small, and two threads on a loaded 2-core
    machine spin-wait (HF's generate ran 5x slower). The engines then take the C linear
    backend, their default with one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines(smollm2_path) -> dict[str, LLM]:
    """With and without prefix caching (a roomy KV cache), and with it in a cache of 40 blocks
    of 8 tokens, where 16 rows of n = 4 samples or 3 beams preempt and evict."""
    return {"on": LLM(smollm2_path, dtype="float32", block_size=BLOCK),
            "off": LLM(smollm2_path, dtype="float32", block_size=BLOCK, enable_prefix_caching=False),
            "tight": LLM(smollm2_path, dtype="float32", block_size=8, kv_cache_memory=320 * BYTES_PER_TOKEN)}


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _weights(path: str) -> int:
    return Path(path, "model.safetensors").stat().st_size


def _run(llm: LLM, prompts: list[list[int]], params) -> tuple[list, dict[str, int], list[int]]:
    """Outputs, the engine's counters for this call alone, and the on_tokens calls."""
    assert llm.reset_prefix_cache(), "the prefix cache must start cold"
    before = llm.stats().to_dict()
    ticks: list[int] = []
    outs = llm.generate(prompts, params, on_tokens=ticks.append)
    after = llm.stats().to_dict()
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    assert not [o.error for o in outs if o.error]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    return outs, delta, ticks


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def _bound(prefixes: list[list[int]], own: list[list[int]]) -> int:
    """Each shared prefix once, every row's own tokens, and one partial block per row."""
    return sum(map(len, prefixes)) + sum(map(len, own)) + len(own) * BLOCK


def _shared_blocks(prompts: list[list[int]]) -> int:
    """Full blocks at the start of every prompt (the rows' own text may begin alike too)."""
    common = 0
    while all(len(p) > common + 1 and p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common // BLOCK


def test_rows_arriving_together_compute_the_prefix_once_greedy(smollm2_path, engines, batch, prompts,
                                                              hf_model, oracle_cache):
    prefix, own = batch
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs, stats, ticks = _run(engines["on"], prompts, greedy)
    assert stats["num_prompt_tokens"] == sum(map(len, prompts))
    assert stats["num_prefill_tokens"] <= _bound([prefix], own)
    shared = _shared_blocks(prompts)
    assert shared >= len(prefix) // BLOCK
    assert stats["prefix_cache_hit_blocks"] == 15 * shared
    assert stats["prefix_cache_hits"] == stats["prefix_cache_hit_blocks"] * BLOCK
    assert [o.stats.num_cached_tokens for o in outs] == [0] + [shared * BLOCK] * 15
    # The progress callback counts generated tokens, never cached (or computed) prompt ones.
    assert sum(ticks) == stats["num_generated_tokens"] <= len(prompts) * MAX_TOKENS

    ref, off_stats, _ = _run(engines["off"], prompts, greedy)
    assert off_stats["num_prefill_tokens"] == sum(map(len, prompts))
    assert _tokens(outs) == _tokens(ref) and _texts(outs) == _texts(ref)

    def compute() -> list[list[int]]:
        return hf_greedy(hf_model, prompts, MAX_TOKENS, [hf_model.generation_config.eos_token_id])

    hf = oracle_cache(["prefix-sharing greedy", _weights(smollm2_path), prompts, MAX_TOKENS], compute)
    assert [t[0] for t in _tokens(outs)] == hf


def test_rows_arriving_together_compute_the_prefix_once_seeded_sampling(engines, batch, prompts):
    """Seeds come from each request's id, so the samples do not depend on what is cached."""
    prefix, own = batch
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS)
    outs, stats, _ = _run(engines["on"], prompts, sampled)
    assert stats["num_prefill_tokens"] <= _bound([prefix], own)
    ref, _, _ = _run(engines["off"], prompts, sampled)
    assert _tokens(outs) == _tokens(ref) and _texts(outs) == _texts(ref)


@pytest.mark.parametrize("kind", ["n4", "beam3"])
def test_samples_and_beams_share_the_prefix_under_eviction_and_preemption(smollm2_path, engines, batch,
                                                                         prompts, hf_model, oracle_cache,
                                                                         kind):
    prefix, own = batch
    if kind == "n4":
        params = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS)
    else:
        params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    outs, stats, _ = _run(engines["tight"], prompts, params)
    assert stats["num_preemptions"] > 0 and stats["num_evictions"] > 0, "the budget was meant to force both"
    assert stats["prefix_cache_hit_blocks"] > 0
    ref, off_stats, _ = _run(engines["off"], prompts, params)
    assert stats["num_prefill_tokens"] < off_stats["num_prefill_tokens"] / 2
    assert _tokens(outs) == _tokens(ref) and _texts(outs) == _texts(ref)
    if kind == "beam3":  # and HF's beam search, on a quarter of the rows (it is slow)
        some = prompts[::4]

        def compute() -> list[list[list[int]]]:
            return [hf_beam(hf_model, p, 3, 1.0, False, MAX_TOKENS)[0] for p in some]

        hf = oracle_cache(["prefix-sharing beams", _weights(smollm2_path), some, MAX_TOKENS], compute)
        ours = [[c.token_ids + ([2] if c.finish_reason == "stop" else []) for c in o.outputs] for o in outs[::4]]
        assert ours == hf


def test_interleaved_prefixes_are_each_computed_once(smollm2_tokenizer, engines):
    topics = ["capitals", "colours", "sums"]
    rows = {t: _rows(smollm2_tokenizer, t) for t in topics}
    order = [(t, i) for i in range(4) for t in topics]  # c0 k0 s0 c1 k1 s1 ...
    prompts = [rows[t][0] + rows[t][1][i] for t, i in order]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs, stats, _ = _run(engines["on"], prompts, greedy)
    assert stats["num_prefill_tokens"] <= _bound([rows[t][0] for t in topics], [rows[t][1][i] for t, i in order])
    assert stats["prefix_cache_hit_blocks"] == sum(3 * _shared_blocks([p for p, (t, _) in zip(prompts, order)
                                                                       if t == topic]) for topic in topics)
    ref, _, _ = _run(engines["off"], prompts, greedy)
    assert _tokens(outs) == _tokens(ref)


def test_the_few_shot_qa_config_computes_its_examples_once(engines, tmp_path):
    """configs/qa_exact_match.yaml says its rows share the few-shot examples' KV blocks."""
    from batchgen.config import load_config
    from batchgen.run.execute import execute
    from batchgen.run.plan import plan
    from batchgen.plugins import load_registry

    root = Path(__file__).resolve().parents[2]
    registry = load_registry([])
    config = load_config(root / "configs" / "qa_exact_match.yaml",
                         [f"data.source={root / 'configs' / 'data' / 'qa.jsonl'}",
                          f"output.path={tmp_path / 'qa.jsonl'}"], registry=registry)
    assert engines["on"].reset_prefix_cache()
    summary = execute(plan(config, registry), quiet=True, llm=engines["on"])
    records = [json.loads(line) for line in (tmp_path / "qa.jsonl").read_text().splitlines()]
    cached = [r["usage"]["cached_tokens"] for r in sorted(records, key=lambda r: r["index"])]
    assert len(cached) == 12 and cached[0] == 0 and all(c >= BLOCK for c in cached[1:])  # row 0 computes
    throughput = summary["throughput"]
    assert throughput["prefill_tokens"] == throughput["prompt_tokens"] - sum(cached)
