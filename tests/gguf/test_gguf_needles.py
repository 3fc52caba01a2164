"""The needle test in ``quantization: gguf`` (as ``tests/engine/test_reproducibility.py`` runs it
on float models): a request's tokens and logprobs are the same bits alone, on one thread (each
decode step one row: the quantized kernel's GEMV path), and inside a batch of random requests
on two threads with the prefill chunked (its rows among others: the kernel's tiles).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import compiler

from tiny_gguf import write_llama_gguf

pytestmark = pytest.mark.skipif(compiler() is None, reason="the quantized CPU kernel needs a C compiler")
TOKENS = 10


def _record(out) -> tuple:  # noqa: ANN001 - a RequestOutput
    assert out.error is None, out.error
    c = out.outputs[0]
    values = [d[t] for d in c.logprobs or [] for t in sorted(d)]
    return c.token_ids, [sorted(d) for d in c.logprobs or []], torch.tensor(values, dtype=torch.float64), \
        torch.tensor([c.cumulative_logprob], dtype=torch.float64)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("linear_type", ["Q4_K", "Q4_1"])
def test_gguf_needles_alone_and_in_a_batch(tmp_path: Path, cache: Path, linear_type: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, linear_type=linear_type, types={"ffn_down": "Q6_K"} if linear_type == "Q4_K" else None)
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(rng.randint(5, 40))] for _ in range(24)]
    needles = [(prompts[0], SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=5, ignore_eos=True)),
               (prompts[1], SamplingParams(temperature=0.8, seed=5, max_tokens=TOKENS, logprobs=5, ignore_eos=True))]
    settings = {"quantization": "gguf", "dtype": "float32", "device": "cpu", "kv_cache_memory": 2**24}
    alone = LLM(str(path), num_threads=1, **settings)
    expected = [_record(alone.generate([p], [sp])[0]) for p, sp in needles]
    del alone
    llm = LLM(str(path), num_threads=2, max_num_batched_tokens=64, **settings)
    fillers = [(p, SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(2, TOKENS)))
               for p in prompts[2:]]
    requests = fillers[:9] + [needles[0]] + fillers[9:17] + [needles[1]] + fillers[17:]
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
    got = [_record(outs[9]), _record(outs[18])]
    assert [_same(a, b) for a, b in zip(expected, got)] == [True, True]
