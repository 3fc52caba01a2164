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


def test_the_engine_section_is_derived_from_engine_config() -> None:
    import dataclasses
    import typing

    from batchgen.config.engine_section import YAML_DEFAULTS, YAML_TYPES, EngineSection
    from batchgen.engine.config import MODEL_KEYS, EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    hints = typing.get_type_hints(EngineConfig)
    assert list(EngineSection.model_fields) == [n for n in fields if n not in MODEL_KEYS]
    for name, schema in EngineSection.model_fields.items():
        assert schema.default == YAML_DEFAULTS.get(name, fields[name].default), name
        assert schema.description == fields[name].metadata["doc"], name
        assert schema.annotation == YAML_TYPES.get(name, hints[name]), name
    # a job's defaults build the engine's defaults (but the few a job sets otherwise, each said why)
    config = validate_config(MINIMAL)
    assert set(YAML_DEFAULTS) <= set(fields) and all(YAML_DEFAULTS[k] != fields[k].default for k in YAML_DEFAULTS)
    assert config.engine.to_engine_config(config.model) == EngineConfig(**YAML_DEFAULTS)


def test_each_choice_is_spelled_once() -> None:
    from typing import get_args

    from batchgen import kernels, model_resolver
    from batchgen.config.engine_section import EngineSection
    from batchgen.engine import config as engine_config
    from batchgen.kernels.cpu import linear

    assert kernels.BACKENDS == get_args(engine_config.AttentionBackend) == engine_config.ATTENTION_BACKENDS
    assert linear.LINEAR_BACKENDS == get_args(engine_config.LinearBackend)
    assert model_resolver.QUANTIZATIONS == get_args(model_resolver.Quantization) == engine_config.QUANTIZATIONS
    assert EngineSection.model_fields["attention_backend"].annotation is engine_config.AttentionBackend
    assert EngineSection.model_fields["quantization"].annotation is model_resolver.Quantization


def test_generation_logprobs_over_max_logprobs_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({**MINIMAL, "generation": {"mode": "sample", "logprobs": 21}})
    (error,) = [str(issue) for issue in info.value.issues]
    assert "'generation.logprobs' is 21, more than 'engine.max_logprobs' (20); ask for fewer, or raise " \
           "engine.max_logprobs (-1: no cap)" in error
    assert validate_config({**MINIMAL, "generation": {"mode": "sample", "logprobs": 21},
                            "engine": {"max_logprobs": 21}}).generation.logprobs == 21
    assert validate_config({**MINIMAL, "generation": {"mode": "sample", "logprobs": 99},
                            "engine": {"max_logprobs": -1}}).generation.logprobs == 99
