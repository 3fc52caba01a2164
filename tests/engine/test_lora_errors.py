"""Bad LoRA adapters: a clear error naming the adapter, on that adapter's requests only; the
other requests of the same call run."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from batchgen import LLM, LoRARequest, SamplingParams  # noqa: E402

from lora_adapters import edit_config, save_adapter  # noqa: E402

PROMPT = [1, 5, 9, 200, 31, 7]


@pytest.fixture(scope="module")
def setup(shared_tiny_model, tmp_path_factory):
    path = shared_tiny_model("llama")
    other = shared_tiny_model("llama", hidden_size=32, intermediate_size=64)
    root = tmp_path_factory.mktemp("bad_adapters")
    good = save_adapter(path, root / "good", 8, ["q_proj", "v_proj"], seed=1)
    bad = {
        "missing": str(root / "no_such_folder"),
        "too_big": save_adapter(path, root / "too_big", 32, ["q_proj"], seed=2),
        "unknown_target": edit_config(good, root / "unknown_target", target_modules=["q_proj", "c_attn"]),
        "other_base": save_adapter(other, root / "other_base", 8, ["q_proj", "v_proj"], seed=3),
        "dora": edit_config(good, root / "dora", use_dora=True),
    }
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=16)
    return llm, good, bad


@pytest.mark.parametrize("case, words", [
    ("missing", "no such adapter folder"),
    ("too_big", "rank 32, above max_lora_rank=16"),
    ("unknown_target", "'c_attn'"),
    ("other_base", "another base model"),
    ("dora", "use_dora=True is not supported"),
])
def test_a_bad_adapter_fails_its_requests_and_the_rest_run(setup, case: str, words: str) -> None:
    llm, good, bad = setup
    requests = [LoRARequest("good", 1, good), LoRARequest(case, 10 + len(case), bad[case]), None]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = llm.generate([PROMPT] * 3, params, lora_request=requests)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == 4
    assert outs[1].error is not None and f"LoRA adapter {case!r}" in outs[1].error and words in outs[1].error
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids


def test_scoring_under_a_bad_adapter_names_it(setup) -> None:
    llm, _, bad = setup
    with pytest.raises(ValueError, match="LoRA adapter 'missing'"):
        llm.loglikelihood([([1, 5], [9, 200])], lora_request=LoRARequest("missing", 99, bad["missing"]))


def test_requests_and_settings_are_checked(shared_tiny_model, setup) -> None:
    _, good, _ = setup
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, good)
    with pytest.raises(ValueError, match="max_lora_rank must be between 1 and 1024"):
        LLM(shared_tiny_model("llama"), enable_lora=True, max_lora_rank=0)
    plain = LLM(shared_tiny_model("llama"))
    out = plain.generate([PROMPT], SamplingParams(max_tokens=2), lora_request=LoRARequest("good", 1, good))[0]
    assert "enable_lora=True" in out.error and "'good'" in out.error
    llm, _, bad = setup
    first, clash = llm.generate([PROMPT] * 2, SamplingParams(max_tokens=2),
                                lora_request=[LoRARequest("good", 1, good), LoRARequest("second", 1, bad["dora"])])
    assert first.error is None
    assert "'second'" in clash.error and "already adapter 'good'" in clash.error
