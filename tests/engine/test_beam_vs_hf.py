"""BeamSearchState, driven naively (the full sequence recomputed by the HF model at each step),
returns exactly what HF ``generate`` returns for beam search: the same sequences, token for
token, and the same ``sequences_scores``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from batchgen.sampling import BeamSearchParams, BeamSearchState
from batchgen.sampling.beam_ranking import BeamHypothesis
from batchgen.sampling.filters import top_candidates

MAX_NEW_TOKENS = 12
TINY_PROMPTS = [[1, 5, 9, 17, 33], [1, 40, 41], [1, 7, 7, 7, 60, 61, 62, 70]]
CASES = [(k, lp, es) for k in (2, 4) for lp in (1.0, 0.6) for es in (True, False, "never")]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The forwards here are tiny (a few dozen tokens); one intra-op thread is as fast and
    avoids OpenMP spin-waiting, which slows such forwards tenfold on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@torch.no_grad()
def naive_beam_search(model: torch.nn.Module, prompt: list[int], params: BeamSearchParams,
                      eos_token_ids: Sequence[int]) -> list[BeamHypothesis]:
    """The simplest engine: no KV cache, every live beam recomputed in full each step."""
    state = BeamSearchState(params, eos_token_ids)
    beams: list[tuple[list[int], float]] = [([], 0.0)]  # the prompt: one beam, logprob 0
    while True:
        batch = torch.tensor([prompt + tokens for tokens, _ in beams])
        logits = model(batch, logits_to_keep=1).logits[:, -1, :]
        candidates = top_candidates(logits, state.num_candidates)
        live = state.step([t for t, _ in beams], [c for _, c in beams], candidates)
        if not live:
            return state.finalize()
        beams = [(beams[parent][0] + [token], cum) for parent, token, cum in live]


@dataclass
class HFBeams:
    sequences: list[list[int]]  # generated part only, padded by HF
    scores: list[float]


@torch.no_grad()
def hf_beam_search(model: torch.nn.Module, prompt: list[int], k: int, length_penalty: float,
                   early_stopping: bool | str, max_new_tokens: int, eos: int | list[int],
                   pad: int) -> HFBeams:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=k, num_return_sequences=k, do_sample=False, length_penalty=length_penalty,
        early_stopping=early_stopping, max_new_tokens=max_new_tokens, output_scores=True,
        return_dict_in_generate=True, eos_token_id=eos, pad_token_id=pad)
    return HFBeams(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist())


def assert_same_beams(ours: list[BeamHypothesis], hf: HFBeams, pad: int) -> None:
    assert len(ours) == len(hf.sequences)
    for hyp, seq, score in zip(ours, hf.sequences, hf.scores):
        n = len(hyp.token_ids)
        assert list(hyp.token_ids) == seq[:n], f"ours {hyp.token_ids} vs HF {seq}"
        assert all(t == pad for t in seq[n:]), f"HF generated more: ours {hyp.token_ids} vs {seq}"
        assert hyp.score == pytest.approx(score, abs=1e-4)


# ------------------------------------------------------------------ tiny random llama
@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, int, int]:
    """A tiny random llama with peaked logits (large init), and an EOS id that it generates.

    The EOS is the token that greedy decoding produces most often on the test prompts, so the
    beams meet it and the finished-hypothesis paths run."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    counts: Counter[int] = Counter()
    with torch.no_grad():
        for p in TINY_PROMPTS:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=3)
            counts.update(out[0, len(p):].tolist())
    eos = next(t for t, _ in counts.most_common() if t != 3)
    return model, eos, 3


@pytest.fixture(scope="module")
def tiny_results(tiny: tuple[torch.nn.Module, int, int]) -> dict:
    model, eos, pad = tiny
    results = {}
    for k, lp, es in CASES:
        for i, prompt in enumerate(TINY_PROMPTS):
            params = BeamSearchParams(beam_width=k, max_tokens=MAX_NEW_TOKENS, length_penalty=lp,
                                      early_stopping=es)
            results[(k, lp, es, i)] = (
                naive_beam_search(model, prompt, params, [eos]),
                hf_beam_search(model, prompt, k, lp, es, MAX_NEW_TOKENS, eos, pad))
    return results


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"), CASES)
def test_tiny_llama_beam_search_equals_hf(tiny_results: dict, tiny: tuple, k: int,
                                          length_penalty: float,
                                          early_stopping: bool | str) -> None:
    for i in range(len(TINY_PROMPTS)):
        ours, hf = tiny_results[(k, length_penalty, early_stopping, i)]
        assert_same_beams(ours, hf, pad=tiny[2])


def test_tiny_llama_cases_exercise_eos_and_length_endings(tiny_results: dict) -> None:
    hyps = [h for ours, _ in tiny_results.values() for h in ours]
    ended_by_eos = sum(h.finish_token_id is not None for h in hyps)
    assert 0 < ended_by_eos < len(hyps)
    assert any(len(h.token_ids) == MAX_NEW_TOKENS for h in hyps)
    assert any(1 < len(h.token_ids) < MAX_NEW_TOKENS for h in hyps)


def test_tiny_llama_min_tokens_multiple_eos_and_fewer_returns(
        tiny: tuple[torch.nn.Module, int, int]) -> None:
    """min_new_tokens, two EOS ids and num_return_sequences < beam_width, as HF does them."""
    model, eos, pad = tiny
    eos_ids = [eos, 21 if eos != 21 else 73]
    prompt = TINY_PROMPTS[0]
    params = BeamSearchParams(beam_width=3, max_tokens=8, min_tokens=2, num_return_sequences=2)
    ours = naive_beam_search(model, prompt, params, eos_ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=2,
                             do_sample=False, max_new_tokens=8, min_new_tokens=2,
                             output_scores=True, return_dict_in_generate=True,
                             eos_token_id=eos_ids, pad_token_id=pad)
    hf = HFBeams(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist())
    assert_same_beams(ours, hf, pad)
    assert all(len(h.token_ids) >= 2 for h in ours)


# ---------------------------------------------------------------------------- SmolLM2
# SmolLM2 token ids of a plain-text prompt and of a short chat turn (its EOS, <|im_end|> = 2,
# can end a beam within the budget). Hard-coded so that the test needs no tokenizer load.
SMOLLM2_PROMPTS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n":
        [1, 4093, 198, 5820, 1296, 4683, 30, 2, 198, 1, 520, 9531, 198],
}


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str) -> torch.nn.Module:
    """The embedded SmolLM2, from the safetensors folder converted once per session (the same
    weights as its GGUF, without de-quantising them again: ~15 s)."""
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("text", list(SMOLLM2_PROMPTS))
def test_smollm2_beam_search_equals_hf(smollm2: torch.nn.Module, text: str) -> None:
    model = smollm2
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = model.generation_config.pad_token_id
    prompt = SMOLLM2_PROMPTS[text]
    params = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=1.0,
                              early_stopping=False)
    ours = naive_beam_search(model, prompt, params, eos_ids)
    hf = hf_beam_search(model, prompt, 2, 1.0, False, 10, eos_ids, pad)
    assert_same_beams(ours, hf, pad)
