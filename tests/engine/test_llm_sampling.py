"""Engine-level sampling behaviour on the real model: seeds, stops, limits, logprobs, text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.slow

W32 = Path(__file__).resolve().parents[2] / "bench" / "w32.jsonl"


@pytest.fixture(scope="module")
def w32() -> list[list[int]]:
    return [json.loads(line)["prompt_token_ids"] for line in W32.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", block_size=16, kv_cache_memory=128 * 2**20)


def test_seed_reproduces_alone_and_inside_a_batch_of_32(llm, w32):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate([w32[3]], seeded)[0].outputs[0].token_ids
    again = llm.generate([w32[3]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(32)]
    batch = llm.generate(w32[:32] + [w32[3]], others + [seeded])
    assert alone == again
    assert batch[-1].outputs[0].token_ids == alone
    # Different seeds really sample differently (the test above could not pass by accident).
    outs = {tuple(o.outputs[0].token_ids) for o in batch[:32]}
    assert len(outs) > 16


def test_temperature_zero_and_top_k_one_equal_greedy(llm, w32):
    prompts = w32[:6]
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))]
    topk1 = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=20))]
    assert topk1 == greedy


def test_max_tokens_min_tokens_and_ignore_eos(llm, w32):
    eos = llm.eos_token_ids[0]
    short = llm.generate([w32[0]], SamplingParams(temperature=0.0, max_tokens=200))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 200  # the model stops by EOS
    assert eos not in short.token_ids  # the stop token is not emitted
    longer = llm.generate([w32[0]], SamplingParams(temperature=0.0, max_tokens=200, min_tokens=len(short.token_ids) + 5))[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert eos not in longer.token_ids[: len(short.token_ids) + 5]
    capped = llm.generate([w32[0]], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 5
    assert capped.token_ids == short.token_ids[:5]
    ignore = llm.generate([w32[0]], SamplingParams(temperature=0.0, max_tokens=len(short.token_ids) + 8, ignore_eos=True))[0].outputs[0]
    assert ignore.finish_reason == "length" and len(ignore.token_ids) == len(short.token_ids) + 8
    assert ignore.token_ids[len(short.token_ids)] == eos


def test_stop_strings_and_stop_token_ids(llm, w32, smollm2_tokenizer):
    base = llm.generate([w32[1]], SamplingParams(temperature=0.0, max_tokens=48))[0].outputs[0]
    words = base.text.split()
    assert len(words) > 6
    stop_word = words[5]
    cut = llm.generate([w32[1]], SamplingParams(temperature=0.0, max_tokens=48, stop=[stop_word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_word
    assert stop_word not in cut.text
    assert base.text.startswith(cut.text) and cut.text == base.text[: base.text.index(stop_word)]
    stop_id = base.token_ids[4]
    by_id = llm.generate([w32[1]], SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id)]


def test_logprobs_and_text_equal_full_decode(llm, w32, smollm2_tokenizer):
    outs = llm.generate(w32[:4], SamplingParams(temperature=0.7, seed=3, max_tokens=40, logprobs=3))
    for out in outs:
        c = out.outputs[0]
        assert c.text == smollm2_tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 3 <= len(entry) <= 4
            assert all(v <= 0.0 for v in entry.values())
            total += entry[tok]
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_incremental_detokenizer_equals_full_decode(smollm2_tokenizer):
    from batchgen.engine.detokenizer import IncrementalDetokenizer

    texts = ["Héllo wörld — naïve café 😀 日本語のテキスト", "  leading spaces\n\ttabs and\nnewlines ",
             "<|im_start|>user\nspecial tokens<|im_end|>"]
    for text in texts:
        ids = smollm2_tokenizer(text)["input_ids"]
        for skip in (True, False):
            d = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=skip)
            pieces = [d.step(t) for t in ids]
            assert "".join(pieces) == d.text == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)


def test_text_prompts_and_input_order(llm, smollm2_tokenizer):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert [o.prompt for o in outs] == prompts
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == smollm2_tokenizer(p)["input_ids"]
        assert len(o.outputs[0].token_ids) == 8


def test_prompt_that_can_never_fit_fails_alone(smollm2_path, w32):
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * 16
    small = LLM(smollm2_path, dtype="float32", block_size=16, kv_cache_memory=8 * bytes_per_block)
    too_long = list(range(100, 100 + 200))  # 200 tokens need 13 blocks; the cache has 8
    outs = small.generate([w32[0], too_long, w32[2]], SamplingParams(temperature=0.0, max_tokens=8))
    assert outs[1].error is not None and "KV blocks" in outs[1].error and "kv_cache_memory" in outs[1].error
    assert outs[1].outputs == []
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) > 0
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) > 0


def test_bad_arguments_are_clear(llm, w32):
    with pytest.raises(ValueError, match="2 params for 3 prompts"):
        llm.generate(w32[:3], [SamplingParams(), SamplingParams()])
    # generate refuses a prompt that can never run before running any (as vLLM does) ...
    with pytest.raises(ValueError, match=r"prompt 1: prompt token ids out of the vocabulary \(0\.\.49151\): \[10000000\]"):
        llm.generate([w32[0], [10**7]], SamplingParams(max_tokens=2))
    # ... and stream (the pipeline's path) fails that request alone, the others go on.
    from batchgen import Request

    outs = {o.request_id: o for o in llm.stream([Request("bad", [10**7], SamplingParams(max_tokens=2)),
                                                  Request("good", w32[0], SamplingParams(max_tokens=2))])}
    assert "vocabulary" in outs["bad"].error and outs["bad"].outputs == []
    assert outs["good"].error is None and len(outs["good"].outputs[0].token_ids) == 2


def test_a_stream_closed_early_leaves_nothing_behind(llm, w32):
    from batchgen import Request

    requests = [Request(f"r{i}", w32[i], SamplingParams(temperature=0.0, max_tokens=30)) for i in range(6)]
    stream = llm.stream(requests)
    first = next(stream)
    stream.close()  # what an exception or Ctrl-C in the caller does
    assert first.request_id.startswith("r")
    assert not llm.scheduler.has_unfinished
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    later = llm.generate([w32[7]], SamplingParams(temperature=0.0, max_tokens=4))
    assert [o.request_id for o in later] == ["0"]
