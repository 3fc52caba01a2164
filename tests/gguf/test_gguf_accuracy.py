"""The ``gguf`` mode against float32 on the same file (SmolLM2's Q4_1 GGUF): the activations'
int8 rounding moves the log-likelihood of text and the greedy choices only within the bounds
docs/kernels.md states ("What the gguf mode costs in accuracy"), measured on all of W32 by
``python -m bench.gguf_accuracy``. The two engines share the weights (``quantization: none``
de-quantizes the same blocks), so the gap is the int8 activations' alone."""

from __future__ import annotations

from functools import partial

import pytest

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import compiler
from batchgen.kernels.cpu.quant import QuantizedLinear
from bench.dtype_accuracy import compare, teacher_forced
from bench.gguf_accuracy import gaps, text_logprobs
from bench.workload import w32_prompts

pytestmark = pytest.mark.skipif(compiler() is None, reason="the int8 kernel needs a C compiler")

TEXTS = (0, 3, 9, 14, 21, 30)  # W32 rows (the full bench scores all 32)
# On all of W32 (2,309 text tokens, 1,888 teacher-forced positions): per-token gap max 0.66
# nats, p99 0.32, mean 0.070; perplexity x0.9997; top-1 agreement 97.4 % (llama.cpp on the
# same file: max 0.56, mean 0.069, perplexity x1.013). The bounds keep a margin over them.
MAX_GAP, MAX_MEAN_GAP, MAX_PERPLEXITY_CHANGE, MIN_TOP1 = 1.0, 0.1, 0.01, 0.95


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return (LLM("smollm2-135m-instruct", quantization="none", dtype="float32"),
            LLM("smollm2-135m-instruct", quantization="gguf"))


@pytest.fixture(scope="module")
def texts() -> list[list[int]]:
    rows = w32_prompts()
    return [rows[i] for i in TEXTS]


def test_the_log_likelihood_of_text_stays_within_the_bound(engines, texts) -> None:
    ref, gguf = engines
    kept = lambda llm: sum(isinstance(m, QuantizedLinear) for m in llm.runner.model.modules())  # noqa: E731
    assert kept(gguf) > 0 and kept(ref) == 0
    got = gaps([text_logprobs(ref, t) for t in texts], [text_logprobs(gguf, t) for t in texts])
    assert got["gap_max"] <= MAX_GAP and got["gap_mean"] <= MAX_MEAN_GAP
    assert abs(got["perplexity_ratio"] - 1) <= MAX_PERPLEXITY_CHANGE
    assert got["gap_mean"] > 0  # the two paths are different computations: a zero gap is a wiring error


def test_greedy_choices_agree_within_the_bound(engines, texts) -> None:
    ref, gguf = engines
    targets = [list(o.outputs[0].token_ids) for o in ref.generate(texts, SamplingParams(temperature=0.0, max_tokens=32))]
    got = compare(partial(teacher_forced, ref), partial(teacher_forced, gguf), texts, targets)
    assert got["reference_self_agreement"] == 1.0
    assert got["top1_agreement"] >= MIN_TOP1 and got["logprob_gap_max"] <= MAX_GAP
