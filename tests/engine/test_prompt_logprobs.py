"""``SamplingParams(prompt_logprobs=k)`` against an HF forward pass (float32, CPU).

The oracle is HF's own logits for the whole prompt in one unpadded pass, through
``log_softmax``: per position the prompt token's logprob and rank, and the ids and values of
the top k. batchgen computes them chunk by chunk from the paged cache, with a cold and a warm
prefix cache, across prefill chunks, and with block sizes 16 and 1.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hf_logprobs import hf_prompt_logprobs

from batchgen import LLM, SamplingParams
from batchgen.sampling.logprobs import chunk_rows_for, reduce_logprobs

TOP_K = 5


def _assert_matches_hf(prompt, ours, ref, num_top, atol=1e-4):
    """``ours`` (RequestOutput.prompt_logprobs) against ``hf_prompt_logprobs`` for ``prompt``."""
    assert len(ours) == len(prompt) and ours[0] is None
    for p in range(1, len(prompt)):
        entry, want = ours[p], ref[p - 1]
        token = prompt[p]
        assert next(iter(entry)) == token, f"position {p}: the prompt token's entry comes first"
        assert entry[token].logprob == pytest.approx(want["logprob"], abs=atol), f"position {p}"
        lo, hi = want["rank_range"]
        assert lo <= entry[token].rank <= hi, f"position {p}: rank {entry[token].rank}, HF {want['rank']}"
        # the top k, and the prompt token's own entry when it is not among them
        top = sorted(((lp.logprob, t) for t, lp in entry.items()), reverse=True)[:num_top]
        gaps = [a - b for a, b in zip(want["top_logprobs"], want["top_logprobs"][1:])]
        if all(g > 1e-4 for g in gaps):  # the order of near-ties is not defined
            assert [t for _, t in top] == want["top_ids"], f"position {p}"
        assert [lp for lp, _ in top] == pytest.approx(want["top_logprobs"], abs=atol), f"position {p}"
        assert len(entry) in (num_top, num_top + 1)


# ----------------------------------------------------------------------------- reduction
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_reduction_equals_a_full_log_softmax(chunk_rows):
    torch.manual_seed(0)
    weight, hidden = torch.randn(500, 16), torch.randn(37, 16)
    targets = torch.randint(0, 500, (37,))
    seen = []

    def logits_of(h):
        seen.append(h.shape[0])
        return h @ weight.T

    got = reduce_logprobs(hidden, targets, logits_of, num_top=4, chunk_rows=chunk_rows)
    full = torch.log_softmax(hidden @ weight.T, dim=-1)
    target_lp = full.gather(1, targets.unsqueeze(1))
    assert got.logprobs == pytest.approx(target_lp.squeeze(1).tolist(), abs=1e-5)
    assert got.ranks == ((full > target_lp).sum(-1) + 1).tolist()
    assert got.top_ids == full.topk(4).indices.tolist()
    assert max(seen) <= chunk_rows and sum(seen) == 37
    assert chunk_rows_for(49152) * 49152 <= 1 << 22


def test_chunk_rows_fill_whole_row_blocks_of_the_quantized_gemm():
    assert chunk_rows_for(49152) == 64  # 85 fit: one block of 64, none of 21
    assert chunk_rows_for(32000) == 128  # 131 fit
    assert chunk_rows_for(151936) == 27  # fewer than a block: as many as fit
    assert chunk_rows_for(10**9) == 1


def test_fused_reduction_is_torch_s_within_rounding_and_row_invariant():
    torch.manual_seed(1)
    weight, hidden = torch.randn(3000, 32), torch.randn(50, 32) * 2
    targets = torch.randint(0, 3000, (50,))
    targets[5] = 7

    def logits_of(h):
        logits = torch.stack([weight @ row for row in h])  # row by row: the same bits in any chunk
        logits[h[:, 0] > 2.0, 7] = float("inf")  # rows the fused pass leaves to torch
        return logits

    assert 0 < int((hidden[:, 0] > 2.0).sum()) < 50 and hidden[5, 0] <= 2.0
    torch_path = reduce_logprobs(hidden, targets, logits_of, num_top=3, chunk_rows=7)
    fused = reduce_logprobs(hidden, targets, logits_of, num_top=3, chunk_rows=7, fused=True)
    inf_rows = (hidden[:, 0] > 2.0).tolist()
    for i, (a, b) in enumerate(zip(fused.logprobs, torch_path.logprobs)):
        if inf_rows[i]:  # another token's logit is +inf: torch.logsumexp's inf, a logprob of -inf
            assert a == -math.inf and math.isnan(b), i  # (torch's in-place path, like log_softmax: NaN)
        else:
            assert a == pytest.approx(b, abs=2e-5), i
    assert fused.ranks == torch_path.ranks and fused.top_ids == torch_path.top_ids
    finite = [i for i in range(50) if not inf_rows[i]]
    assert [fused.top_logprobs[i] for i in finite] == [pytest.approx(torch_path.top_logprobs[i], abs=2e-5)
                                                       for i in finite]
    # a row's numbers are its own: alone, in other chunks, with or without alternatives
    alone = reduce_logprobs(hidden[23:24], targets[23:24], logits_of, chunk_rows=1, fused=True)
    other = reduce_logprobs(hidden, targets, logits_of, num_top=0, chunk_rows=64, fused=True)
    assert alone.logprobs[0] == fused.logprobs[23] == other.logprobs[23]
    assert alone.ranks[0] == fused.ranks[23] == other.ranks[23]
    assert [other.logprobs[i] for i in finite] == [fused.logprobs[i] for i in finite]


# ----------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny(shared_tiny_model):
    from transformers import AutoModelForCausalLM

    path = shared_tiny_model("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size,max_batched", [(16, 2048), (16, 24), (1, 2048)])
def test_tiny_prompt_logprobs_equal_hf_cold_and_warm(tiny, block_size, max_batched):
    path, hf = tiny
    llm = LLM(path, dtype="float32", block_size=block_size, max_num_batched_tokens=max_batched)
    rng = random.Random(block_size + max_batched)
    shared = rng.choices(range(300, 20000), k=40)
    prompts = [shared + rng.choices(range(300, 20000), k=n) for n in (3, 17, 30)]
    params = SamplingParams(prompt_logprobs=TOP_K, max_tokens=2, temperature=0.0)
    refs = [hf_prompt_logprobs(hf, p, TOP_K) for p in prompts]
    cold = llm.generate(prompts, params)
    before = llm.stats()
    warm = llm.generate(prompts, params)  # every prompt's blocks are cached now
    after = llm.stats()
    for prompt, ref, c, w in zip(prompts, refs, cold, warm):
        _assert_matches_hf(prompt, c.prompt_logprobs, ref, TOP_K)
        _assert_matches_hf(prompt, w.prompt_logprobs, ref, TOP_K)
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
    # scored positions are computed even though their blocks are cached
    assert after.num_prefill_tokens - before.num_prefill_tokens >= sum(len(p) for p in prompts)
    # without prompt logprobs the same prompts hit the cache
    plain = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in cold]
    assert all(o.prompt_logprobs is None for o in plain)
    assert llm.stats().num_prefill_tokens - after.num_prefill_tokens < sum(len(p) for p in prompts) - 40


def test_scoring_only_and_k0(tiny):
    path, hf = tiny
    llm = LLM(path, dtype="float32")
    prompt = random.Random(1).choices(range(300, 20000), k=33)
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    ref = hf_prompt_logprobs(hf, prompt, 0)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert list(entry) == [prompt[p]]  # k=0: only the prompt token's own entry
        lp = entry[prompt[p]]
        assert lp.logprob == pytest.approx(ref[p - 1]["logprob"], abs=1e-4) and lp.rank == ref[p - 1]["rank"]
        assert lp.decoded_token == llm.tokenizer.decode([prompt[p]])
    # the scoring request runs the prompt but its last token
    assert llm.stats().num_prefill_tokens == len(prompt) - 1
    one = llm.generate([[prompt[0]]], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None] and one.error is None
    start = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1, prompt_logprobs_start=20))[0]
    assert start.prompt_logprobs[:20] == [None] * 20
    assert start.prompt_logprobs[25][prompt[25]].logprob == pytest.approx(out.prompt_logprobs[25][prompt[25]].logprob, abs=1e-5)


def test_scoring_params_are_validated():
    with pytest.raises(ValueError, match="max_tokens=0 .*prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(ValueError, match="n"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, n=2)


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_model_prompt_logprobs_equal_hf_cold_and_warm(smollm2_path, smollm2_tokenizer, oracle_cache):
    from transformers import AutoModelForCausalLM

    texts = ["The history of the printing press begins in the fifteenth century, when Johannes "
             "Gutenberg combined movable type with an oil-based ink and a screw press.",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]
    prompts = [smollm2_tokenizer(t)["input_ids"] for t in texts]
    weights = Path(smollm2_path, "model.safetensors").stat().st_size

    def compute():
        hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
        return [hf_prompt_logprobs(hf, p, TOP_K) for p in prompts]

    refs = oracle_cache(["prompt_logprobs", weights, prompts, TOP_K], compute)
    llm = LLM(smollm2_path, dtype="float32")
    params = SamplingParams(prompt_logprobs=TOP_K, max_tokens=0)
    cold = llm.generate(prompts, params)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # warm the prefix cache
    warm = llm.generate(prompts, params)
    for prompt, ref, c, w in zip(prompts, refs, cold, warm):
        _assert_matches_hf(prompt, c.prompt_logprobs, ref, TOP_K)
        _assert_matches_hf(prompt, w.prompt_logprobs, ref, TOP_K)
