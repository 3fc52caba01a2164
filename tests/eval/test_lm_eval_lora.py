"""The lm-eval backend with a LoRA adapter (``model_args`` ``lora=PATH`` or
``lora_local_path=PATH``): loglikelihoods equal lm-eval's ``hf`` model with the same adapter
(``peft=PATH``) on a tiny random llama."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("peft") is None,
                                reason='needs lm-eval and peft: pip install "batchgen[lm-eval,test]"')

PAIRS = [("The capital of France is", " Paris"), ("Question: 2+2=\nAnswer: ", "4"), ("A", " b c d e f g")]


@pytest.fixture(scope="module")
def setup(shared_tiny_model, tmp_path_factory):
    from lora_adapters import ALL, save_adapter

    path = shared_tiny_model("llama")
    adapter = save_adapter(path, tmp_path_factory.mktemp("lm_eval_lora") / "adapter", 8, ALL, seed=7, std=0.2)
    return path, adapter


@pytest.mark.parametrize("key", ["lora", "lora_local_path"])
def test_loglikelihoods_equal_hf_with_the_peft_adapter(setup, key: str) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from batchgen.integrations.lm_eval import BatchgenLM

    path, adapter = setup
    ours = BatchgenLM(pretrained=path, dtype="float32", block_size=4, max_length=64, **{key: adapter})
    hf = HFLM(pretrained=path, peft=adapter, dtype="float32", device="cpu", batch_size=4, max_length=64)
    base = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=4, max_length=64)
    req = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)]
    got, want, plain = ours.loglikelihood(req), hf.loglikelihood(req), base.loglikelihood(req)
    for (lp, greedy), (ref, ref_greedy), (base_lp, _) in zip(got, want, plain):
        assert abs(lp - ref) <= 1e-4 and greedy == ref_greedy
        assert abs(lp - base_lp) > 1e-3  # the adapter is applied
    assert ours.get_model_info()["lora"] == adapter


def test_a_bad_adapter_fails_at_load_naming_it(setup, tmp_path) -> None:
    from batchgen.integrations.lm_eval import BatchgenLM

    path, adapter = setup
    with pytest.raises(ValueError, match="no such adapter folder"):
        BatchgenLM(pretrained=path, dtype="float32", lora=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="give one"):
        BatchgenLM(pretrained=path, dtype="float32", lora=adapter, lora_local_path=str(tmp_path))
