"""Parallel sampling and beam search over shared, copy-on-write blocks (the real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracles import hf_beam

from batchgen import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

W32 = Path(__file__).resolve().parents[2] / "bench" / "w32.jsonl"
BEAM_TOKENS = 20


@pytest.fixture(scope="module")
def w32() -> list[list[int]]:
    return [json.loads(line)["prompt_token_ids"] for line in W32.read_text().splitlines() if line.strip()]


def test_n4_sampling_prefills_once_shares_blocks_and_reproduces(smollm2_path, w32):
    prompt = w32[0]  # 69 tokens: 4 full blocks of 16 and a partial one of 5
    assert len(prompt) % 16 != 0
    params = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=7, max_tokens=16)
    llm = LLM(smollm2_path, dtype="float32", block_size=16, enable_prefix_caching=False)
    seen_tables: list[list[list[int]]] = []
    original = llm.runner.execute

    def spy(scheduled, sample, copies, *rest):
        seen_tables.append([list(seq.block_table) for seq, _ in scheduled])
        return original(scheduled, sample, copies, *rest)

    llm.runner.execute = spy
    out = llm.generate([prompt], params)[0]
    stats = llm.stats()
    assert stats.num_prefill_tokens == len(prompt), "the prompt must be prefilled exactly once"
    assert len(out.outputs) == 4
    # The first decode step: all four samples name the prompt's blocks, the partial one
    # included, except the copied last block of the ones that wrote first (copy-on-write).
    first_decode = seen_tables[1]
    assert len(first_decode) == 4
    full = len(prompt) // 16
    assert all(t[:full] == first_decode[0][:full] for t in first_decode)
    assert stats.num_cow_copies == 3, "the shared partial block is copied by 3 of 4 writers"
    assert out.stats.num_physical_blocks < out.stats.num_logical_blocks
    # Reproducible, and the four samples differ from each other.
    again = LLM(smollm2_path, dtype="float32", block_size=16).generate([prompt], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_best_of_returns_the_best_n(smollm2_path, w32):
    llm = LLM(smollm2_path, dtype="float32")
    wide = llm.generate([w32[2]], SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=12))[0]
    best = llm.generate([w32[2]], SamplingParams(n=2, best_of=6, temperature=1.0, seed=11, max_tokens=12))[0]
    expected = sorted((o.cumulative_logprob for o in wide.outputs), reverse=True)[:2]
    assert [o.cumulative_logprob for o in best.outputs] == pytest.approx(expected)


@pytest.fixture(scope="module")
def hf_beams(smollm2_path, w32, oracle_cache, hf_map):
    """``hf_beams(width, length_penalty, early_stopping)``: HF's beams for the 8 test prompts,
    computed once per setting (the CPU-linear case shares the torch case's) and cached."""
    model = None
    weights = Path(smollm2_path, "model.safetensors").stat().st_size

    def compute(width, length_penalty, early_stopping):
        nonlocal model
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
        return hf_map(lambda p: hf_beam(model, p, width, length_penalty, early_stopping, BEAM_TOKENS), w32[:8])

    def get(width, length_penalty, early_stopping):
        key = ["beam", weights, w32[:8], width, length_penalty, early_stopping, BEAM_TOKENS]
        return oracle_cache(key, lambda: compute(width, length_penalty, early_stopping))

    return get


# Every pair of values of (width, length_penalty, early_stopping) once: 4 cases, not the 8 of
# the full product. The ranking rules themselves are checked on all 12 combinations (with
# early_stopping="never") against HF in test_beam_vs_hf.py; here the paged engine runs them,
# where what matters is how beams fork, share and free their blocks as they end, which the
# width and the stop rule decide, each value of which meets each value of the others here.
PAIRWISE = [(2, 1.0, True), (2, 0.6, False), (4, 1.0, False), (4, 0.6, True)]


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), PAIRWISE)
def test_beam_search_equals_hf(smollm2_path, hf_beams, w32, width, length_penalty, early_stopping,
                               linear_backend="auto"):
    """On the default path (batchgen's C kernels wherever they build), and on torch's layers."""
    from batchgen.kernels.cpu.linear import unsupported_reason

    prompts = w32[:8]
    llm = LLM(smollm2_path, dtype="float32", block_size=16, linear_backend=linear_backend)
    default = "cpu" if unsupported_reason(torch.float32, torch.device("cpu")) is None else "torch"
    assert llm.runner.linear_backend == (default if linear_backend == "auto" else linear_backend)
    params = BeamSearchParams(beam_width=width, max_tokens=BEAM_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=width)
    outs = llm.generate(prompts, params)
    for out, (ref_seqs, ref_scores) in zip(outs, hf_beams(width, length_penalty, early_stopping)):
        ours = [o.token_ids + ([2] if o.finish_reason == "stop" else []) for o in out.outputs]
        assert ours == ref_seqs
        assert [o.score for o in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    stats = llm.stats()
    assert stats.saving > 0.2, "beams must share their prompt blocks"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_beam_search_equals_hf_on_the_torch_linear_backend(smollm2_path, hf_beams, w32):
    """torch's own linear layers (where the C kernels cannot run): beams and scores stay HF's."""
    test_beam_search_equals_hf(smollm2_path, hf_beams, w32, 4, 1.0, False, linear_backend="torch")


@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_preempted_groups_give_the_same_outputs(smollm2_path, w32, kind):
    prompts = w32[:6]
    if kind == "beam":
        params = BeamSearchParams(beam_width=3, max_tokens=24)
    else:
        params = SamplingParams(n=3, temperature=0.8, seed=21, max_tokens=24)
    roomy = LLM(smollm2_path, dtype="float32", block_size=8)
    ref = roomy.generate(prompts, params)
    assert roomy.stats().num_preemptions == 0
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * 8
    tight = LLM(smollm2_path, dtype="float32", block_size=8, kv_cache_memory=70 * bytes_per_block)
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0, "the budget was meant to force preemption"
    for a, b in zip(ref, got):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
