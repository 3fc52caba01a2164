"""The engine on the kernel ops: SmolLM2 greedy tokens with the CUDA kernels (run by the CPU
harness) equal those of the torch reference backend. This pins the engine-to-kernel call
contract (argument layouts, dtypes, strided views) without a GPU."""

from __future__ import annotations

import pytest

from cuda_harness.backend import HarnessBackend

from batchgen.kernels.cuda.cuda_attention import KernelOps


@pytest.mark.slow
def test_greedy_tokens_match_the_torch_backend(smollm2_path: str) -> None:
    from batchgen import LLM, SamplingParams

    # linear_backend="torch": HF's attention layers through the attention interface, the path
    # a GPU takes (the CPU path's fused attention layers write the cache themselves)
    llm = LLM(model=smollm2_path, attention_backend="torch", linear_backend="torch",
              kv_cache_memory=32 * 2**20, block_size=16)
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.runner.ops = KernelOps(HarnessBackend(schedule="warp", poison="nan"))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert all(len(t) == 3 for t in got)
