"""Models the paged cache cannot run exactly are refused with a clear error."""

from __future__ import annotations

import pytest

from batchgen.engine.model_loader import UnsupportedModelError, check_supported, resolve_dtype


def _config(model_type: str, **kwargs):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


def _cls(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def test_llama_qwen2_mistral_are_accepted():
    assert check_supported(_config("llama"), _cls(_config("llama"))) is None
    assert check_supported(_config("qwen2"), _cls(_config("qwen2"))) is None
    mistral = _config("mistral", sliding_window=512)
    assert check_supported(mistral, _cls(mistral)) == 512  # context capped at the window


def test_encoder_decoder_is_refused():
    t5 = _config("t5")
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        check_supported(t5, None)


def test_alibi_model_is_refused():
    bloom = _config("bloom")
    with pytest.raises(UnsupportedModelError, match="bloom"):
        check_supported(bloom, _cls(bloom))


def test_softcapping_is_refused():
    gemma2 = _config("gemma2")
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        check_supported(gemma2, _cls(gemma2))


def test_refusal_reaches_the_user_through_llm(tmp_path):
    from transformers import AutoConfig

    from batchgen import LLM

    AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gemma2"):
        LLM(str(tmp_path))


def test_dtype_names():
    import torch

    assert resolve_dtype("float32", None, torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", None, torch.device("cpu")) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", None, torch.device("cpu"))
