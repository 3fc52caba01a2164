"""``LLM.loglikelihood`` and ``LLM.loglikelihood_rolling`` against HF and lm-eval.

Oracles:
* tokenisation and windows: lm-eval's own code (``HFLM``'s pair encoding, and
  ``get_rolling_token_windows`` / ``make_disjoint_window``);
* values: an unpadded HF forward pass in float32 on the real SmolLM2 model, reduced as
  lm-eval's ``hf`` model reduces it (``log_softmax`` gather, argmax for ``is_greedy``);
* work: a prefix trie of the requests' tokens (what must be computed at least once);
* memory: the peak RSS of a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hf_logprobs import hf_loglikelihood, loglikelihood_tolerance

from batchgen import LLM
from batchgen.engine import loglikelihood as ll

# 12 questions with different contexts, 2..5 choices, continuations of 1..20 tokens; the
# "Photosynth" and "The word is un" choices start mid-word, with no space; the last question
# has an empty context (the prefix token stands for it).
QUESTIONS = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " London", " Berlin", " Madrid"]),
    ("The boiling point of water at sea level is", [" 100 degrees Celsius", " 50 degrees Celsius"]),
    ("Question: Which planet is known as the Red Planet?\nAnswer:",
     [" Mars", " Venus", " Jupiter", " Saturn", " Mercury"]),
    ("She opened the door and saw a",
     [" cat", " dog", " huge elephant standing quietly in the middle of her living room, eating all "
      "the house plants one by one"]),
    ("The quick brown fox jumps over the lazy", [" dog", " cat", " fence"]),
    ("Photosynth", ["esize", " is"]),
    ("Q: 2 + 2 = ?\nA: ", ["4", "5", "22"]),
    ("In 1492, Columbus sailed across the", [" Atlantic Ocean", " Pacific Ocean", " Indian Ocean", " Arctic Ocean"]),
    ("def add(a, b):\n    return", [" a + b", " a - b"]),
    ("The word is un", ["believable", " fair", " known"]),
    ("The opposite of hot is", [" cold", " warm", " spicy", " burning", " freezing"]),
    ("", ["Once upon a time", "Hello world"]),
]
PAIRS = [(c, ch) for c, choices in QUESTIONS for ch in choices]


def _lm_eval_pairs(tokenizer, pairs):
    """lm-eval's ``hf`` tokenisation of text pairs: its ``loglikelihood`` up to the point
    where it hands ``(context ids, continuation ids)`` to the model."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM.__new__(HFLM)  # the tokenisation needs only these attributes, not a model
    lm.tokenizer, lm.add_bos_token, lm.custom_prefix_token_id = tokenizer, None, None
    lm.backend, lm.enable_thinking = "causal", False
    captured = []
    lm._loglikelihood_tokens = lambda reqs, disable_tqdm=False: captured.extend(reqs)
    lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    return [(list(ctx), list(cont)) for _, ctx, cont in captured]


# ----------------------------------------------------------------------------- tokenisation
def test_pairs_tokenise_as_lm_eval(smollm2_tokenizer):
    ours = ll.tokenize_pairs(smollm2_tokenizer, PAIRS)
    assert ours == _lm_eval_pairs(smollm2_tokenizer, PAIRS)
    lengths = [len(cont) for _, cont in ours]
    assert min(lengths) == 1 and max(lengths) == 20


@pytest.mark.parametrize("n,max_length", [(1, 4), (4, 4), (5, 4), (17, 4), (100, 7), (3000, 1024), (9, 1)])
def test_rolling_windows_are_lm_eval_windows(n, max_length):
    lm_utils = pytest.importorskip("lm_eval.utils")
    tokens = random.Random(n).choices(range(100, 200), k=n)
    expected = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
        token_list=tokens, prefix_token=1, max_seq_len=max_length, context_len=1)]
    windows = ll.rolling_windows(tokens, 1, max_length)
    assert windows == [(list(a), list(b)) for a, b in expected]
    assert [t for _, cont in windows for t in cont] == tokens  # each token scored once
    assert all(len(a) + len(b) <= max_length + 1 for a, b in windows)


def test_fit_window_truncates_the_context_from_the_left():
    ctx, cont = list(range(10)), [50, 51, 52]
    assert ll.fit_window(ctx, cont, 12, truncate=False) == (ctx, cont)  # 13 tokens: the model reads 12
    assert "13 tokens" in ll.fit_window(ctx, cont, 11, truncate=False)
    assert ll.fit_window(ctx, cont, 11, truncate=True) == (ctx[1:], cont)
    assert "continuation has 3 tokens" in ll.fit_window(ctx, cont, 2, truncate=True)


# ----------------------------------------------------------------------------- real model vs HF
@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_pairs(smollm2_path, smollm2_tokenizer, hf_model, oracle_cache, hf_map):
    """HF's (logprob, is_greedy) of every pair, on lm-eval's tokenisation."""
    pairs = _lm_eval_pairs(smollm2_tokenizer, PAIRS)
    weights = Path(smollm2_path, "model.safetensors").stat().st_size

    def compute():
        def one(pair):
            with torch.inference_mode():
                return list(hf_loglikelihood(hf_model, *pair))
        return hf_map(one, pairs)

    return oracle_cache(["loglikelihood", weights, pairs], compute)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    """The real-model engine shared by this module's slow tests (block size 16)."""
    return LLM(smollm2_path, dtype="float32")


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 1])
def test_loglikelihood_equals_hf(block_size, smollm2_path, smollm2_llm, hf_pairs, smollm2_tokenizer):
    llm = smollm2_llm if block_size == 16 else LLM(smollm2_path, dtype="float32", block_size=1)
    ours = llm.loglikelihood(PAIRS)
    assert len(ours) == len(PAIRS)
    lengths = [len(continuation) for _, continuation in _lm_eval_pairs(smollm2_tokenizer, PAIRS)]
    off = [(abs(a[0] - b[0]), n) for a, b, n in zip(ours, hf_pairs, lengths)]
    assert all(d <= loglikelihood_tolerance(n) for d, n in off), \
        f"largest difference {max(d for d, _ in off):.2e} nats ({sorted(off)[-3:]} as (nats, tokens))"
    assert [g for _, g in ours] == [g for _, g in hf_pairs]
    assert any(g for _, g in ours) and not all(g for _, g in ours)
    # token-id pairs give the same numbers as the text pairs they tokenise to
    ids = ll.tokenize_pairs(llm.tokenizer, PAIRS[:5])
    again = llm.loglikelihood(ids)
    assert [lp for lp, _ in again] == pytest.approx([lp for lp, _ in ours[:5]], abs=1e-5)
    assert [g for _, g in again] == [g for _, g in ours[:5]]


@pytest.mark.slow
def test_loglikelihood_rolling_equals_hf_windows(smollm2_llm, smollm2_tokenizer, hf_model, oracle_cache, smollm2_path):
    words = random.Random(7).choices(
        "the of and to in is was for on that with as by at from his an were are which this be "
        "river mountain city history science music ocean forest language people".split(), k=2600)
    text = " ".join(words).capitalize() + "."
    tokens = ll.encode(smollm2_tokenizer, text)
    assert 2500 <= len(tokens) <= 3500
    max_length = 1024  # forces 3 or 4 windows
    windows = ll.rolling_windows(tokens, ll.prefix_token_id(smollm2_tokenizer), max_length)
    assert len(windows) >= 3
    weights = Path(smollm2_path, "model.safetensors").stat().st_size
    # HF's per-window sums two ways: lm-eval's float32 log_softmax, and the same float32
    # logits through a float64 log_softmax (see hf_loglikelihood)
    expected = oracle_cache(["rolling-fp32-fp64", weights, windows], lambda: [
        [hf_loglikelihood(hf_model, a, b)[0], hf_loglikelihood(hf_model, a, b, exact=True)[0]] for a, b in windows])
    ours = smollm2_llm.loglikelihood_rolling([text, text[:200]], max_length=max_length)
    assert ours[0] == pytest.approx(sum(e for _, e in expected), abs=1e-3)
    assert ours[0] == pytest.approx(sum(f for f, _ in expected), abs=1e-5 * len(tokens))
    short = ll.encode(smollm2_tokenizer, text[:200])
    prefix = [ll.prefix_token_id(smollm2_tokenizer)]
    assert ours[1] == pytest.approx(hf_loglikelihood(hf_model, prefix, short, exact=True)[0], abs=1e-4)


# ----------------------------------------------------------------------------- work (tiny model)
@pytest.fixture(scope="module")
def tiny_llm(shared_tiny_model):
    return LLM(shared_tiny_model("llama"), dtype="float32", block_size=16)


def _trie_size(sequences) -> int:
    """Distinct token prefixes of the sequences: each must be computed at least once."""
    nodes: set[tuple[int, ...]] = set()
    for seq in sequences:
        for i in range(1, len(seq) + 1):
            nodes.add(tuple(seq[:i]))
    return len(nodes)


def test_shared_context_is_computed_once(tiny_llm):
    rng = random.Random(3)
    fewshot = rng.choices(range(300, 20000), k=300)
    pairs = []
    for _ in range(16):
        context = fewshot + rng.choices(range(300, 20000), k=rng.randint(20, 40))
        for _ in range(4):
            pairs.append((context, rng.choices(range(300, 20000), k=rng.randint(1, 12))))
    tiny_llm.reset_prefix_cache()
    before = tiny_llm.stats().num_prefill_tokens
    results = tiny_llm.loglikelihood(pairs)
    computed = tiny_llm.stats().num_prefill_tokens - before
    # the model reads each pair but its last token
    unique = _trie_size([ctx + cont[:-1] for ctx, cont in pairs])
    bound = unique + 16 * len(pairs)
    total = sum(len(ctx) + len(cont) - 1 for ctx, cont in pairs)
    assert computed <= bound, f"computed {computed} prefill tokens; unique {unique}, bound {bound}"
    assert computed < total / 4
    # the same numbers as scoring each pair alone, with a cold cache
    for i in (0, 5, 63):
        tiny_llm.reset_prefix_cache()
        assert tiny_llm.loglikelihood([pairs[i]])[0][0] == pytest.approx(results[i][0], abs=1e-4)


# ----------------------------------------------------------------------------- bad input
def test_bad_pairs_name_the_request(tiny_llm):
    with pytest.raises(ValueError, match="request 1: the continuation is empty"):
        tiny_llm.loglikelihood([("a b", " c"), ("a b", "")])
    with pytest.raises(ValueError, match="request 0: context and continuation must both"):
        tiny_llm.loglikelihood([("a b", [5, 6])])
    long_ctx = list(range(100, 100 + 1030))
    with pytest.raises(ValueError, match="request 1: context plus continuation have 1033 tokens"):
        tiny_llm.loglikelihood([([5, 6], [7]), (long_ctx, [7, 8, 9])])
    truncated = tiny_llm.loglikelihood([(long_ctx, [7, 8, 9])], truncate=True)
    kept = long_ctx[-(1024 + 1 - 3):]
    assert truncated[0][0] == pytest.approx(tiny_llm.loglikelihood([(kept, [7, 8, 9])])[0][0], abs=1e-4)
    with pytest.raises(ValueError, match="max_length"):
        tiny_llm.loglikelihood([([5], [6])], max_length=5000)


def test_a_too_long_scoring_request_fails_alone(tiny_llm):
    """Through the engine's request stream (as the run layer uses it): an error output for
    that request, the others scored."""
    ok = ll.to_request("ok", [5, 6, 7], [8, 9])
    too_long = ll.to_request("long", list(range(100, 1100)), list(range(30, 60)))
    outs = {o.request_id: o for o in tiny_llm.stream([ok, too_long])}
    assert outs["long"].error and "1030 tokens" in outs["long"].error
    assert outs["ok"].error is None
    assert ll.loglikelihood_of(outs["ok"]) == pytest.approx(tiny_llm.loglikelihood([([5, 6, 7], [8, 9])])[0])


# ----------------------------------------------------------------------------- memory
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, random, resource, sys
    from batchgen import LLM
    path, n = sys.argv[1], int(sys.argv[2])
    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=2048)
    tokens = random.Random(0).choices(range(300, 20000), k=n)
    llm.loglikelihood([([1], tokens[:8])])  # warm up: every kernel and buffer made once
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    windows = len(__import__("batchgen.engine.loglikelihood", fromlist=["x"]).rolling_windows(tokens, 1, 1024))
    total = llm.loglikelihood_rolling([tokens], max_length=1024)[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kib": base, "peak_kib": peak, "windows": windows, "total": total}))
""")

#: Peak-RSS growth allowed while scoring 8K tokens (MiB). Unreduced, one step's prefill chunk
#: of logits ([2048 positions x 49152] float32) would be 384 MiB, and the whole 8K-token text's
#: 1.5 GiB. Measured (Intel Xeon, 2 threads): 22-28 MiB for 1K, 8K and 32K tokens alike.
PEAK_RSS_GROWTH_MIB = 64


def test_rolling_peak_memory_is_bounded(shared_tiny_model):
    """Peak RSS while scoring, in a fresh process. glibc's malloc raises its mmap threshold
    as large blocks are freed, and then keeps freed chunk buffers in its heap (seen: 40 to
    300 MiB, varying from run to run whatever the length); a fixed threshold makes RSS show
    what the engine holds."""
    path = shared_tiny_model("llama", max_position_embeddings=1024)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}

    def growth(n: int) -> tuple[float, int]:
        out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, path, str(n)], capture_output=True,
                             text=True, timeout=600, check=True, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return (result["peak_kib"] - result["base_kib"]) / 1024, result["windows"]

    short, _ = growth(1024)
    long, windows = growth(8192)
    assert windows == 8
    assert long < PEAK_RSS_GROWTH_MIB, f"peak RSS grew {long:.0f} MiB while scoring 8K tokens"
    assert long < short + 16, f"8K tokens grew peak RSS by {long:.0f} MiB, 1K tokens by {short:.0f} MiB"
