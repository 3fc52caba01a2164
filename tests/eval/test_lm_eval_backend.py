"""The lm-eval backend without the real model: registration, the missing extra, gen_kwargs, and
its loglikelihoods against lm-eval's ``hf`` model on a tiny random llama."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason='the lm-eval backend needs: pip install "batchgen[lm-eval]"')


def test_without_lm_eval_the_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "batchgen.integrations.lm_eval", raising=False)
    with pytest.raises(ImportError, match=r'pip install "batchgen\[lm-eval\]"'):
        importlib.import_module("batchgen.integrations.lm_eval")


def test_batchgen_lm_eval_command_without_lm_eval_exits_2(monkeypatch, capsys):
    from batchgen.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "batchgen.integrations.lm_eval", raising=False)
    assert main(["lm-eval", "run", "--model", "batchgen"]) == 2
    assert 'pip install "batchgen[lm-eval]"' in capsys.readouterr().err


@needs_lm_eval
def test_importing_registers_batchgen_and_keeps_lm_evals_models():
    from lm_eval.api.registry import get_model

    from batchgen.integrations.lm_eval import BatchgenLM

    assert get_model("batchgen") is BatchgenLM
    assert get_model("hf").__name__ == "HFLM"  # the built-in names are still found after ours


@needs_lm_eval
def test_batchgen_lm_eval_help_is_lm_evals(capsys):
    from batchgen.cli import main

    assert main(["lm-eval", "run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--tasks" in out


@pytest.fixture(scope="module")
def tiny_llama(shared_tiny_model) -> str:
    return shared_tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    from batchgen.integrations.lm_eval import BatchgenLM

    return BatchgenLM(pretrained=tiny_llama, dtype="float32", block_size=4, max_length=64, num_threads=1)


@needs_lm_eval
def test_gen_kwargs_become_sampling_params(tiny_lm):
    sp, until = tiny_lm._sampling_params({"until": ["\n"], "max_gen_toks": 7}, "<eos>")
    assert (sp.temperature, sp.max_tokens, until, sp.stop) == (0.0, 7, ["\n", "<eos>"], ["\n", "<eos>"])
    sp, _ = tiny_lm._sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                      "max_new_tokens": 3, "until": "x"}, "<eos>")
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.stop) == (0.7, 0.9, 5, 3, ["x", "<eos>"])
    sp, _ = tiny_lm._sampling_params({"do_sample": False, "temperature": 0.7}, "<eos>")
    assert sp.temperature == 0.0 and sp.max_tokens == tiny_lm.max_gen_toks
    with pytest.raises(ValueError, match="penalty_alpha"):
        tiny_lm._sampling_params({"penalty_alpha": 0.6}, "<eos>")


@needs_lm_eval
def test_loglikelihoods_equal_lm_evals_hf_model_on_a_tiny_llama(tiny_llama, tiny_lm):
    """Text pairs (empty context, a trailing space, mid-word continuations whose first token merges
    with the context's last, one past
    max_length that both truncate from the left) and rolling texts of several windows."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    hf = HFLM(pretrained=tiny_llama, dtype="float32", device="cpu", batch_size=4, max_length=64)
    long_context = " ".join(["the cat sat on the mat"] * 30)
    pairs = [("The capital of France is", " Paris"), ("Question: 2+2=\nAnswer: ", "4"), ("", "Hello world"),
             ("The opposite of happy is un", "believable"), ("The word is straw", "well"), (long_context, " and then it slept for a while"),
             ("A", " b c d e f g h i j k l m n o p q r s t")]
    req = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    ours, theirs = tiny_lm.loglikelihood(req), hf.loglikelihood(req)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(ours, theirs):
        assert abs(lp - ref_lp) <= 1e-4 and greedy == ref_greedy, (lp, ref_lp)
    texts = [("word " * 150).strip(), "Just a few words.", "x"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    for lp, ref in zip(tiny_lm.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)):
        assert abs(lp - ref) <= 1e-4 * max(1.0, abs(ref) / 10), (lp, ref)


@needs_lm_eval
def test_model_args_pass_through_to_the_engine_config(tiny_llama):
    from batchgen.engine.config import EngineConfig
    from batchgen.integrations.lm_eval import BatchgenLM

    lm = BatchgenLM(pretrained=tiny_llama, dtype="float32", num_threads=1, kv_cache_memory="4MiB",
                    max_num_seqs=3, max_model_len=48, batch_size=8)
    config = lm.llm.config
    assert (config.kv_cache_memory, config.max_num_seqs, config.max_model_len) == (4 * 2**20, 3, 48)
    defaults = EngineConfig()
    assert (config.block_size, config.seed, config.attention_backend) == (
        defaults.block_size, defaults.seed, defaults.attention_backend)  # the engine's defaults, not its own
    assert lm.max_length == 48
    with pytest.raises(TypeError, match="unknown engine setting.*blok_size"):
        BatchgenLM(pretrained=tiny_llama, blok_size=4)
