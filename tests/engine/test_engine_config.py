"""EngineConfig: one place checks every engine setting; LLM and ModelRunner take it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.engine.config import EngineConfig


@pytest.mark.parametrize(("changes", "message"), [
    ({"block_size": 0}, "block_size must be between 1 and 256, got 0"),
    ({"block_size": 257}, "block_size must be between 1 and 256, got 257"),
    ({"dtype": "float8"}, "unknown dtype 'float8'"),
    ({"kv_cache_dtype": "fp8"}, "unknown kv_cache_dtype 'fp8'"),
    ({"device": "cuda 1"}, "device must be"),
    ({"kv_cache_memory": -1}, "kv_cache_memory must be a number of bytes > 0"),
    ({"kv_cache_memory": True}, "kv_cache_memory must be a number of bytes > 0"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens must be an integer >= 1"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of prefix, fcfs; got 'lifo'"),
    ({"attention_backend": "tpu"}, "attention_backend must be one of auto, cpu, cuda, torch; got 'tpu'"),
    ({"linear_backend": "gpu"}, "linear_backend must be one of auto, cpu, torch; got 'gpu'"),
    ({"seed": "1"}, "seed must be an integer or None"),
    ({"num_threads": 0}, "num_threads must be 'auto' or an integer >= 1"),
    ({"num_threads": True}, "num_threads must be 'auto' or an integer >= 1"),
    ({"index_checks": 1}, "index_checks must be true or false"),
    ({"quantization": "int4"}, "quantization must be one of auto, gguf, none; got 'int4'"),
])
def test_bad_values_are_refused_naming_the_setting(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineConfig(**changes)


def test_every_error_at_once():
    with pytest.raises(ValueError) as info:
        EngineConfig(block_size=0, dtype="float8", quantization="x")
    assert "block_size" in str(info.value) and "dtype" in str(info.value) and "quantization" in str(info.value)


def test_unknown_keyword_names_all_of_them():
    with pytest.raises(TypeError, match="unknown engine setting.*blok_size, dtyp"):
        EngineConfig.from_kwargs("m", blok_size=4, dtyp="float32")


def test_defaults_and_replace():
    config = EngineConfig()
    assert config.model == "smollm2-135m-instruct" and config.quantization == "auto"
    assert config.replace(block_size=8).block_size == 8
    with pytest.raises(ValueError, match="block_size"):
        config.replace(block_size=0)
    assert EngineConfig(**config.to_dict()) == config


def test_import_is_torch_free():
    code = ("import sys; from batchgen import EngineConfig; EngineConfig(block_size=8); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llm_takes_a_config_or_keywords(tiny_model):
    from batchgen import LLM, SamplingParams

    path = tiny_model("llama")
    config = EngineConfig(model=path, dtype="float32", block_size=8, kv_cache_memory=4 * 2**20,
                          max_num_seqs=3, scheduling_policy="fcfs", seed=5)
    by_config = LLM(config=config)
    by_keywords = LLM(path, dtype="float32", block_size=8, kv_cache_memory=4 * 2**20, max_num_seqs=3,
                      scheduling_policy="fcfs", seed=5)
    assert by_config.config == by_keywords.config == config
    assert by_config.runner.engine_config is config
    assert by_config.block_manager.block_size == 8 and by_config.scheduler.max_num_seqs == 3
    assert by_config.runner.kv_cache.num_bytes <= 4 * 2**20
    params = SamplingParams(max_tokens=6, temperature=0.8)
    a = by_config.generate(["Hello there", "One two"], params)
    b = by_keywords.generate(["Hello there", "One two"], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # keywords override a given config's fields
    assert LLM(config=config, block_size=4).config.block_size == 4
    with pytest.raises(TypeError, match="unknown engine setting"):
        LLM(path, blok_size=4)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_under_a_float32_model(tiny_model, kv_cache_dtype):
    """``kv_cache_dtype``: the cache holds the K/V rows in 16 bits (twice the blocks in the same
    memory), and the model's log-likelihoods move only by that rounding; a 16-bit model keeps
    its KV in its own dtype."""
    import torch

    from batchgen import LLM

    path = tiny_model("llama")
    full = LLM(path, dtype="float32", kv_cache_memory=4 * 2**20)
    half = LLM(path, dtype="float32", kv_cache_memory=4 * 2**20, kv_cache_dtype=kv_cache_dtype)
    assert full.runner.kv_cache.kv_cache.dtype == torch.float32
    assert half.runner.kv_cache.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert half.runner.kv_cache.num_blocks == 2 * full.runner.kv_cache.num_blocks
    pairs = [("The quick brown fox", " jumps over the lazy dog and runs far away"),
             ("One two three", " four five six seven eight nine ten")]
    for (a, _), (b, _) in zip(full.loglikelihood(pairs), half.loglikelihood(pairs)):
        assert a != 0.0 and abs(a - b) <= 0.02, (a, b)
    with pytest.raises(ValueError, match="16-bit model keeps its KV in its own dtype"):
        LLM(path, dtype="bfloat16", kv_cache_dtype="float16")
