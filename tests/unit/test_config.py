"""Config loading: schema, overrides, all-errors-at-once reporting and plugin checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pluggy
import pytest
from pydantic import BaseModel, ConfigDict

from batchgen.config import (
    ConfigError,
    GenerationSection,
    RunConfig,
    apply_overrides,
    load_config,
    plugin_modules,
    validate_config,
)
from batchgen.plugins import MetricSpec, PluginRegistry, SamplerSpec, hookimpl, hookspecs

MINIMAL = {"data": {"source": "prompts.jsonl"}, "output": {"path": "out.jsonl"}}


def _errors(data: dict[str, Any], registry: Any = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data, registry=registry)
    return [str(issue) for issue in info.value.issues]


def _with(**sections: Any) -> dict[str, Any]:
    return {**MINIMAL, **sections}


def test_minimal_config_fills_defaults() -> None:
    config = validate_config(MINIMAL)
    assert config.model.name == "smollm2-135m-instruct"
    assert config.prompt.prompt_column == "prompt"
    assert config.generation.mode == "greedy" and config.generation.num_outputs == 1
    assert config.output.if_exists == "error"
    assert config.output.summary_file == Path("out.summary.json")


def test_unknown_key_gets_did_you_mean_and_valid_keys() -> None:
    errors = _errors(_with(generation={"max_token": 5}))
    assert errors == [
        "generation.max_token: unknown key (did you mean 'max_tokens'?); valid keys here: "
        + ", ".join(f"'{k}'" for k in GenerationSection.model_fields)
    ]


def test_unknown_section_gets_did_you_mean() -> None:
    (error,) = _errors(_with(engnie={}))
    assert error.startswith("engnie: unknown key (did you mean 'engine'?)")


def test_wrong_type_names_path_and_value() -> None:
    (error,) = _errors(_with(engine={"block_size": "big"}))
    assert error == "engine.block_size: expected an integer, got 'big'"


def test_bad_choice_lists_choices_with_suggestion() -> None:
    (error,) = _errors(_with(generation={"mode": "beams"}))
    assert error == "generation.mode: invalid value 'beams' (did you mean 'beam'?); valid: 'greedy', 'sample', 'beam', 'loglikelihood', 'perplexity'"


def test_scheduling_policy_defaults_to_prefix_order() -> None:
    assert validate_config(_with()).engine.scheduling_policy == "prefix"
    assert validate_config(_with(engine={"scheduling_policy": "fcfs"})).engine.scheduling_policy == "fcfs"
    (error,) = _errors(_with(engine={"scheduling_policy": "lpm"}))
    assert error == "engine.scheduling_policy: invalid value 'lpm'; valid: 'prefix', 'fcfs'"


def test_missing_required_keys() -> None:
    errors = _errors({})
    assert errors == ["data: required key is missing", "output: required key is missing"]


def test_all_errors_reported_at_once() -> None:
    errors = _errors(
        {
            "model": {"devise": "cpu"},
            "data": {"source": "x", "limit": 0},
            "engine": {"kv_cache_memory": "lots"},
            "output": {},
        }
    )
    assert [e.split(":")[0] for e in errors] == [
        "model.devise",
        "data.limit",
        "engine.kv_cache_memory",
        "output.path",
    ]
    with pytest.raises(ConfigError) as info:
        validate_config({"model": {"devise": "cpu"}, "data": {}, "output": {}}, source="job.yaml")
    assert str(info.value).startswith("job.yaml: invalid config (3 errors):\n  - model.devise: unknown key")


def test_mode_specific_keys_rejected_in_other_modes() -> None:
    (error,) = _errors(_with(generation={"mode": "greedy", "temperature": 0.7, "beam_width": 2}))
    assert error == "generation: with mode 'greedy': 'temperature' applies to mode 'sample', 'beam_width' applies to mode 'beam'"
    config = validate_config(_with(generation={"mode": "sample", "n": 4, "temperature": 0.7}))
    assert config.generation.num_outputs == 4
    config = validate_config(_with(generation={"mode": "beam", "beam_width": 3}))
    assert config.generation.num_outputs == 3


def test_beam_rejects_per_token_sampler_knobs() -> None:
    (error,) = _errors(_with(generation={"mode": "beam", "repetition_penalty": 1.2, "sampler": {"name": "typical"}}))
    assert error == "generation: beam search does not support 'repetition_penalty', 'sampler'; use mode 'sample' or 'greedy' for them"
    (error,) = _errors(_with(generation={"max_tokens": 4, "min_tokens": 5}))
    assert error == "generation: min_tokens (5) must be <= max_tokens (4)"


def test_prompt_section_rules() -> None:
    (error,) = _errors(_with(prompt={"column": "q", "template": "{{ q }}"}))
    assert error == "prompt: set either 'column' or 'template', not both"
    (error,) = _errors(_with(prompt={"template": "Q: {{ question }\nA:"}))
    assert error.startswith("prompt: template syntax error on line 1:")
    (error,) = _errors(_with(prompt={"chat_template": False, "system_prompt": "Be brief."}))
    assert "'system_prompt' needs the chat template" in error


def test_device_and_bytes_parsing() -> None:
    config = validate_config(_with(model={"device": "cuda:1"}, engine={"kv_cache_memory": "64MiB"}))
    assert config.model.device == "cuda:1" and config.engine.kv_cache_memory == 64 * 2**20
    (error,) = _errors(_with(model={"device": "gpu"}))
    assert error == "model.device: unknown device 'gpu' (did you mean 'cpu'?); valid: 'auto', 'cpu', 'cuda' or 'cuda:N'"


def test_duplicate_metric_keys_need_labels() -> None:
    (error,) = _errors(_with(metrics=[{"name": "contains"}, {"name": "contains"}]))
    assert error == "metrics: two metrics are keyed 'contains'; give one a distinct 'label'"
    config = validate_config(_with(metrics=[{"name": "contains"}, {"name": "contains", "label": "c2"}]))
    assert [m.key for m in config.metrics] == ["contains", "c2"]


# ----------------------------------------------------------------------------- plugins


class _ExactOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ignore_case: bool = False


class _TypicalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mass: float = 0.9


class _Plugin:
    """Registers ``typical``, ``exact_match`` and ``contains``, as a plugin would (no built-ins)."""

    @hookimpl
    def batchgen_register_samplers(self) -> list[SamplerSpec]:
        return [SamplerSpec("typical", "", _TypicalOptions, lambda o: None)]

    @hookimpl
    def batchgen_register_metrics(self) -> list[MetricSpec]:
        return [MetricSpec(name, "", _ExactOptions, lambda o: None) for name in ("exact_match", "contains")]


def _Registry() -> PluginRegistry:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(_Plugin(), name="test-plugin")
    return PluginRegistry(pm, {})


def test_unknown_plugins_get_suggestion_and_installed_list() -> None:
    errors = _errors(
        _with(metrics=[{"name": "exact_mach"}], generation={"sampler": {"name": "typcal"}}),
        registry=_Registry(),
    )
    assert errors == [
        "generation.sampler: unknown sampler plugin 'typcal' (did you mean 'typical'?); installed: 'typical'",
        "metrics.0: unknown metric plugin 'exact_mach' (did you mean 'exact_match'?); installed: 'contains', 'exact_match'",
    ]


def test_invalid_plugin_options_name_the_plugin() -> None:
    errors = _errors(
        _with(
            metrics=[{"name": "exact_match", "options": {"ignore_cas": True}}],
            generation={"sampler": {"name": "typical", "options": {"mass": "heavy"}}},
        ),
        registry=_Registry(),
    )
    assert errors == [
        "generation.sampler: invalid options for sampler plugin 'typical': mass: Input should be a valid number, unable to parse string as a number",
        "metrics.0: invalid options for metric plugin 'exact_match': ignore_cas: unknown option (did you mean 'ignore_case'?); valid: 'ignore_case'",
    ]


def test_plugins_unchecked_without_registry() -> None:
    config = validate_config(_with(metrics=[{"name": "anything", "options": {"x": 1}}]))
    assert config.metrics[0].options == {"x": 1}


# ----------------------------------------------------------------------------- files and --set


def test_load_config_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "data:\n  source: p.jsonl\noutput:\n  path: o.jsonl\nmetrics:\n  - name: contains\n"
    )
    config = load_config(
        path,
        [
            "output.path=/tmp/x.jsonl",
            "data.limit=5",
            'generation.stop=["\\n", "###"]',
            "prompt.system_prompt=null",
            "metrics.0.options={ignore_case: true}",
            "engine.kv_cache_memory=32MiB",
        ],
    )
    assert config.output.path == "/tmp/x.jsonl"
    assert config.data.limit == 5
    assert config.generation.stop == ["\n", "###"]
    assert config.metrics[0].options == {"ignore_case": True}
    assert config.engine.kv_cache_memory == 32 * 2**20


def test_override_errors() -> None:
    with pytest.raises(ConfigError, match=r"--set: expected KEY.PATH=VALUE, got 'data.limit'"):
        apply_overrides(MINIMAL, ["data.limit"])
    with pytest.raises(ConfigError, match=r"data.source.x: --set: 'data.source' is not a mapping"):
        apply_overrides(MINIMAL, ["data.source.x=1"])
    with pytest.raises(ConfigError, match=r"metrics.3: --set: no list item 3 \(the list has 0\)"):
        apply_overrides({**MINIMAL, "metrics": []}, ["metrics.3.name=x"])
    # An unknown key set from the command line gets the same did-you-mean as one in the file.
    (error,) = _errors(apply_overrides(MINIMAL, ["data.limt=3"]))
    assert error.startswith("data.limt: unknown key (did you mean 'limit'?)")


def test_yaml_problems(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  source: [unclosed\noutput: {}\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line \d+, column \d+"):
        load_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping of sections, got list"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    # Unsafe tags are refused by the safe loader.
    path.write_text("data: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_config(path)


def test_plugin_modules_peek(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("plugins: [my_plugin]\ndata: {source: x}\noutput: {path: y}\n")
    assert plugin_modules(path) == ["my_plugin"]
    assert plugin_modules(path, ["plugins=[a, b]"]) == ["a", "b"]
    assert plugin_modules(path, ["plugins=3"]) == []


def test_resolved_config_round_trips() -> None:
    config = validate_config(_with(engine={"kv_cache_memory": "1MiB"}))
    dumped = config.model_dump(mode="json")
    assert RunConfig.model_validate(dumped) == config


@pytest.mark.parametrize("mode", ["loglikelihood", "perplexity", "beam"])
def test_a_resolved_config_of_every_mode_loads_again(mode: str) -> None:
    """The dump holds every key at its default (``stop: []`` included, a default_factory's);
    a default is not a key 'used' by another mode."""
    scoring = {"loglikelihood": {"choices": ["A", "B"], "answer": "label"}, "perplexity": {}}
    generation = {"mode": mode, **scoring.get(mode, {"beam_width": 2})}
    config = validate_config(_with(generation=generation))
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config


# ----------------------------------------------------------------------------- engine settings


@pytest.mark.parametrize("override,expected", [
    ("engine.kv_cache_memory=-1", "engine.kv_cache_memory: must be > 0 (got -1)"),
    ("engine.kv_cache_memory=-5MiB", "engine.kv_cache_memory: must be > 0 (got '-5MiB')"),
    ("engine.kv_cache_memory=true", "engine.kv_cache_memory: expected a size such as '512MiB' or a number of bytes, "
     "got true; a boolean is not a size"),
    ("engine.kv_cache_memory=1.5", "engine.kv_cache_memory: expected a whole number of bytes or a size such as '512MiB', got 1.5"),
    ("engine.num_threads=true", "engine.num_threads: expected a positive integer or 'auto', got true; a boolean is not a count"),
    ("engine.num_threads=0", "engine.num_threads: expected a positive integer or 'auto', got 0"),
    ("engine.num_threads=many", "engine.num_threads: expected a positive integer or 'auto', got 'many'"),
])
def test_bad_engine_sizes_and_counts_say_what_they_take(override: str, expected: str) -> None:
    # One issue each, at the key --set names (no internal path such as '.constrained-int').
    assert _errors(apply_overrides(MINIMAL, [override])) == [expected]


def test_engine_section_builds_the_engine_config() -> None:
    import dataclasses

    from batchgen.engine.config import EngineConfig

    config = validate_config(apply_overrides(MINIMAL, [
        "engine.kv_cache_memory=64MiB", "engine.num_threads=3", "engine.block_size=32", "engine.scheduling_policy=fcfs",
        "engine.seed=7", "model.dtype=bfloat16", "model.device=cpu"]))
    built = config.engine.to_engine_config(config.model)
    assert isinstance(built, EngineConfig)
    assert (built.kv_cache_memory, built.num_threads, built.block_size, built.scheduling_policy, built.seed) == (
        64 * 2**20, 3, 32, "fcfs", 7)
    assert (built.model, built.dtype, built.device) == (config.model.name, "bfloat16", "cpu")
    # Every engine key of the YAML reaches the engine: none is dropped on the way.
    assert set(type(config.engine).model_fields) <= {f.name for f in dataclasses.fields(EngineConfig)}
    for key in type(config.engine).model_fields:
        value = getattr(config.engine, key)
        assert getattr(built, key) == (int(value) if key == "kv_cache_memory" else value), key


# ----------------------------------------------------------------------------- structured outputs


@pytest.mark.parametrize("key,value", [("regex", r"[^\s\S]"), ("regex", r"(ab|cd)[^\s\S]"),
                                       ("json", {"type": "string", "pattern": r"[^\s\S]"})])
def test_a_constraint_nothing_can_match_is_named_at_validation(key: str, value: Any) -> None:
    pytest.importorskip("xgrammar", reason="structured outputs need the 'structured' extra")
    (error,) = _errors(_with(generation={"structured_outputs": {key: value}}))
    what = "JSON schema" if key == "json" else key
    assert error == (f"generation.structured_outputs.{key}: no output can match this {what}: it compiles, but it "
                     "allows no text at all, so every row would fail")


@pytest.mark.parametrize("value", [r"[a-z]+", r"\d{3}-\d{4}", "x{100}"])
def test_constraints_that_can_match_pass(value: str) -> None:
    # The search is bounded: an output longer than it looks (x{100}) is left to the run, never refused.
    pytest.importorskip("xgrammar", reason="structured outputs need the 'structured' extra")
    assert validate_config(_with(generation={"structured_outputs": {"regex": value}})).generation.structured_outputs.regex == value


# The rules that tie data.format and output.format to the other sections. Their wording, their
# key path (the config as a whole: "") and their order are what users and scripts see; these
# cases pin them for whichever module ends up holding the rules.
BATCH = {"data": {"source": "in.jsonl", "format": "openai_batch"}, "output": {"path": "out.jsonl"}}
LINES_CARRY = "with data.format 'openai_batch' each line carries its own prompt and generation parameters; drop "
NO_ALIASES = "'model.aliases' applies to data.format 'openai_batch' only"
NO_METRICS = "metrics score batchgen records; with output.format 'openai_batch' drop 'metrics' or write output.format 'jsonl'"
SAME_PATHS = "'output.error_path' must differ from 'output.path'"


def _issues(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    return [(issue.path, issue.message) for issue in info.value.issues]


def test_output_format_auto_follows_the_data_format() -> None:
    assert validate_config(BATCH).output.format == "openai_batch"
    assert validate_config(MINIMAL).output.format == "jsonl"
    # Given formats are kept whatever the source: any source goes with any record format.
    assert validate_config({**BATCH, "output": {"path": "o", "format": "jsonl"}}).output.format == "jsonl"
    assert validate_config(_with(output={"path": "o", "format": "openai_batch"})).output.format == "openai_batch"


def test_a_batch_file_names_every_key_it_makes_meaningless_in_one_issue() -> None:
    data = {**BATCH, "data": {**BATCH["data"], "split": "test", "limit": 3}, "prompt": {"template": "{{ x }}"},
            "generation": {"max_tokens": 5, "mode": "sample", "temperature": 0.5}}
    assert _issues(data) == [("", LINES_CARRY + "'data.split', 'prompt.template', 'generation.max_tokens', "
                                  "'generation.mode', 'generation.temperature'")]
    # data.limit and keys given at their defaults are fine with a batch file.
    cfg = validate_config({**BATCH, "data": {**BATCH["data"], "limit": 3}, "generation": {"max_tokens": 64},
                           "prompt": {"system_prompt": None}})
    assert cfg.data.limit == 3


def test_format_rules_report_together_in_order() -> None:
    assert _issues(_with(model={"aliases": ["gpt"]})) == [("", NO_ALIASES)]
    assert _issues({**BATCH, "metrics": [{"name": "length"}]}) == [("", NO_METRICS)]
    assert _issues(_with(output={"path": "o.jsonl", "error_path": "./o.jsonl"})) == [("", SAME_PATHS)]
    every = _with(model={"aliases": ["gpt"]}, metrics=[{"name": "length"}],
                  output={"path": "o.jsonl", "format": "openai_batch", "error_path": "o.jsonl"})
    assert _issues(every) == [("", f"{NO_ALIASES}; {NO_METRICS}; {SAME_PATHS}")]
    # Metrics with a batch file written as batchgen records are fine.
    assert validate_config({**BATCH, "output": {"path": "o", "format": "jsonl"}, "metrics": [{"name": "length"}]})
    # A schema error stops them: the sections did not validate, so nothing ties them yet.
    assert _issues({**BATCH, "prompt": {"template": "{{ x }}"}, "engine": {"num_threads": "x"}}) == [
        ("engine.num_threads", "expected a positive integer or 'auto', got 'x'")
    ]


def test_format_rules_exit_2_at_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    job = tmp_path / "job.yaml"
    job.write_text('data: {source: in.jsonl, format: openai_batch}\nprompt: {template: "{{ x }}"}\n'
                   "output: {path: out.jsonl}\n")
    assert main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"batchgen: error: {job}: invalid config: {LINES_CARRY}'prompt.template'"
    assert not (tmp_path / "out.jsonl").exists()


def test_every_format_of_the_schema_has_a_kind() -> None:
    from typing import get_args

    from batchgen.config import DataSection, OutputSection
    from batchgen.config.formats import BATCH_LINES, BATCHGEN_RECORDS, DATASET_ROWS, RESPONSE_LINES, kinds

    for data_format in get_args(DataSection.model_fields["format"].annotation):
        for output_format in get_args(OutputSection.model_fields["format"].annotation):
            config = validate_config(_with(data={"source": "x", "format": data_format},
                                           output={"path": "o", "format": output_format}))
            source, records = kinds(config)
            assert source is (BATCH_LINES if data_format == "openai_batch" else DATASET_ROWS)
            assert records is {"auto": source.records, "jsonl": BATCHGEN_RECORDS, "openai_batch": RESPONSE_LINES}[output_format]
            assert config.output.format == records.name
