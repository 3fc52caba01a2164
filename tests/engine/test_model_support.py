"""Models the paged cache cannot run exactly are refused with a clear error."""

from __future__ import annotations

import pytest

from batchgen.engine.model_loader import UnsupportedModelError, check_supported, expected_windows, resolve_dtype


def _config(model_type: str, **kwargs):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


def _cls(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


@pytest.mark.parametrize("model_type, kwargs", [
    ("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 512}), ("qwen3", {}),
    ("gemma2", {}), ("gemma3_text", {}), ("phi3", {}),
])
def test_windowed_and_soft_capped_models_are_accepted(model_type, kwargs):
    config = _config(model_type, **kwargs)
    check_supported(config, _cls(config))  # no cap, no refusal


def test_each_layer_window_as_hf_masks_apply_it():
    assert expected_windows(_config("llama", num_hidden_layers=2)) == [None, None]
    assert expected_windows(_config("mistral", sliding_window=512, num_hidden_layers=2)) == [512, 512]
    qwen2 = _config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=3)
    assert expected_windows(qwen2) == [None, 16, 16]
    assert expected_windows(_config("qwen2", sliding_window=16, num_hidden_layers=2)) == [None, None]
    gemma2 = _config("gemma2", sliding_window=16, num_hidden_layers=4)
    assert expected_windows(gemma2) == [16, None, 16, None]


@pytest.mark.parametrize("model_type, kwargs, match", [
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional"),
    ("llama", {"attention_chunk_size": 64}, "chunked attention"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention"], "num_hidden_layers": 2}, "chunked_attention layers"),
])
def test_attention_kinds_the_paged_attention_does_not_run_are_refused(model_type, kwargs, match):
    config = _config(model_type, **kwargs)
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(config, _cls(config))


def test_encoder_decoder_is_refused():
    t5 = _config("t5")
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        check_supported(t5, None)


def test_alibi_model_is_refused():
    bloom = _config("bloom")
    with pytest.raises(UnsupportedModelError, match="bloom"):
        check_supported(bloom, _cls(bloom))


def test_refusal_reaches_the_user_through_llm(tmp_path):
    from transformers import AutoConfig

    from batchgen import LLM

    AutoConfig.for_model("gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        LLM(str(tmp_path))


def test_a_model_that_does_not_pass_its_window_is_refused_on_the_first_step(tiny_model):
    # a layer whose attention call leaves out the sliding window its config (and HF's mask)
    # gives it would run full attention: the first step's check refuses it instead
    from batchgen import LLM, SamplingParams
    from batchgen.engine import paged_attention

    forward = paged_attention.paged_attention_forward

    def without_window(*args, **kwargs):
        kwargs.pop("sliding_window", None)
        return forward(*args, **kwargs)

    llm = LLM(tiny_model("mistral", sliding_window=16, head_dim=16), dtype="float32", linear_backend="torch")
    paged_attention.AttentionInterface.register(paged_attention.ATTENTION_NAME, without_window)
    try:
        with pytest.raises(UnsupportedModelError, match="layer 0 attended with sliding window None"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
    finally:
        paged_attention.AttentionInterface.register(paged_attention.ATTENTION_NAME, forward)


def test_dtype_names():
    import torch

    assert resolve_dtype("float32", None, torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", None, torch.device("cpu")) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", None, torch.device("cpu"))
