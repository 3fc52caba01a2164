"""The engine args of vLLM scripts in a job's ``engine:`` section: checked with the engine's
messages and carried to the engine."""

from __future__ import annotations

from typing import Any

import pytest

from batchgen.config import ConfigError, validate_config

MINIMAL: dict[str, Any] = {"data": {"source": "x.jsonl"}, "output": {"path": "out.jsonl"}}


def _errors(engine: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config({**MINIMAL, "engine": engine})
    return [str(issue) for issue in info.value.issues]


def test_engine_args_reach_the_engine_config() -> None:
    config = validate_config({**MINIMAL, "engine": {"max_model_len": 512, "tokenizer": "some/tokenizer",
                                                     "max_logprobs": 5, "tensor_parallel_size": 1,
                                                     "gpu_memory_utilization": 0.8}})
    built = config.engine.to_engine_config(config.model)
    assert (built.max_model_len, built.tokenizer, built.max_logprobs, built.tensor_parallel_size,
            built.gpu_memory_utilization) == (512, "some/tokenizer", 5, 1, 0.8)
    defaults = validate_config(MINIMAL).engine.to_engine_config(validate_config(MINIMAL).model)
    assert (defaults.max_model_len, defaults.tokenizer, defaults.max_logprobs, defaults.gpu_memory_utilization) == (
        None, None, 20, None)


@pytest.mark.parametrize(("engine", "expected"), [
    ({"tensor_parallel_size": 2}, "engine.tensor_parallel_size: tensor_parallel_size=2 is not supported: batchgen runs "
     "one model per device; to use several devices run data-parallel replicas on Ray"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_memory": "1GiB"}, "engine: give one of gpu_memory_utilization"),
    ({"gpu_memory_utilization": 2}, "engine.gpu_memory_utilization:"),
    ({"max_model_len": 0}, "engine.max_model_len:"),
    ({"max_logprobs": -5}, "engine.max_logprobs:"),
    ({"max_model_len_": 5}, "engine.max_model_len_: unknown key (did you mean 'max_model_len'?)"),
])
def test_bad_engine_args_name_the_key(engine: dict[str, Any], expected: str) -> None:
    (error,) = _errors(engine)
    assert error.startswith(expected), error
