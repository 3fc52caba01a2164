"""Sampler and metric names across plugins (docs/plugins.md, "Names"): a built-in never breaks
an installed plugin, ``PLUGIN:NAME`` reaches every registration, and a clash between two
third-party plugins fails only the job that uses the bare name.

Each rule is tested with real plugin modules listed under ``plugins:`` and with entry-point
plugins of installed-looking distributions (a ``.dist-info`` folder importlib.metadata finds),
through the registry, the config validation and the real command line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from batchgen.config import ConfigError, load_config, plugin_modules, resolved_dict
from batchgen.plugins import PluginError, load_registry
from registry_lookup import plugin_of

MakeModule = Callable[[str, str], str]

# A third-party metric named like a built-in: it scores every record 7, which no built-in does.
JSON_VALID = """
from pydantic import BaseModel, ConfigDict
from batchgen.plugins import MetricSpec, hookimpl

class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seven: int = 7

class Mine:
    name = "json_valid"
    def __init__(self, seven):
        self.seven = seven
    def score(self, record, row):
        return {"mine": self.seven}
    def aggregate(self, scores):
        return {"mine": float(self.seven)}

@hookimpl
def batchgen_register_metrics():
    return [MetricSpec("json_valid", "A metric written before batchgen had one.", Options, lambda o: Mine(o.seven))]
"""

# Two third-party plugins registering one sampler name; each masks a different token.
MASKER = """
from pydantic import BaseModel, ConfigDict
from batchgen.plugins import SamplerSpec, hookimpl

class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

def mask(logits, output_token_ids):
    logits[:, {token}] = float("-inf")
    return logits

@hookimpl
def batchgen_register_samplers():
    return [SamplerSpec("masker", "Mask token {token}.", Options, lambda o: mask)]
"""

RECORD = {"id": "r", "generations": [{"text": '{"a": 1}', "finish_reason": "stop"}]}


def masked_token(proc) -> int:
    import torch

    out = proc(torch.zeros(1, 4), [[]])
    (token,) = torch.isneginf(out[0]).nonzero().flatten().tolist()
    return token


# ----------------------------------------------------------------------------- built-in clash


def check_builtin_clash(registry, plugin: str, qualifiers: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The plugin's json_valid wins the bare name with one warning; the built-in stays reachable."""
    with caplog.at_level(logging.WARNING, logger="batchgen.plugins"):
        mine = registry.build_metric("json_valid", {})
        registry.build_metric("json_valid", {"seven": 8})  # used again: no second warning
    assert mine.score(RECORD, {}) == {"mine": 7} and mine.plugin == plugin
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"metric 'json_valid' of plugin '{plugin}'" in warnings[0]
    assert "write 'batchgen:json_valid' for the built-in" in warnings[0]
    for name in ("batchgen:json_valid", "batchgen-builtin-metrics:json_valid"):
        builtin = registry.build_metric(name, {})
        assert builtin.plugin == "batchgen-builtin-metrics"
        assert builtin.score(RECORD, {}) == {"first": True, "any": True, "mean": 1.0}
    for qualifier in qualifiers:
        assert registry.build_metric(f"{qualifier}:json_valid", {}).score(RECORD, {}) == {"mine": 7}
    assert registry.metrics["json_valid"] is registry.resolve("metric", f"{plugin}:json_valid").spec
    # The other built-ins are untouched, and still answer their bare names.
    assert plugin_of(registry, "metric", "exact_match") == "batchgen-builtin-metrics"


def test_builtin_clash_with_a_yaml_listed_module(make_module: MakeModule, caplog: pytest.LogCaptureFixture) -> None:
    name = make_module("bg_my_json_valid", JSON_VALID)
    check_builtin_clash(load_registry([name]), name, [name], caplog)


def test_builtin_clash_with_an_entry_point(make_module: MakeModule, make_distribution,
                                           caplog: pytest.LogCaptureFixture) -> None:
    make_module("bg_my_json_valid", JSON_VALID)
    make_distribution("Batchgen-JSON_Tools", "1.2", "jsontools = bg_my_json_valid")
    # By the plugin's name, and by its distribution's name however pip would spell it.
    check_builtin_clash(load_registry(), "jsontools", ["jsontools", "batchgen-json-tools", "Batchgen-JSON_Tools"], caplog)


# ----------------------------------------------------------------------------- third-party clash


def check_third_party_clash(registry, first: str, second: str) -> None:
    with pytest.raises(PluginError) as info:
        registry.build_sampler("masker", {})
    message = str(info.value)
    assert message.startswith(f"sampler 'masker' is registered by 2 plugins: plugin '{first}' ")
    assert f" and plugin '{second}' " in message
    assert message.endswith(f"; write one of '{first}:masker' or '{second}:masker' to choose")
    assert "masker" not in registry.samplers
    assert masked_token(registry.build_sampler(f"{first}:masker", {})) == 1
    assert masked_token(registry.build_sampler(f"{second}:masker", {})) == 2
    assert plugin_of(registry, "sampler", "epsilon") == "batchgen-builtin-samplers"  # nothing else is touched


def test_third_party_clash_between_yaml_listed_modules(make_module: MakeModule) -> None:
    first = make_module("bg_masker_one", MASKER.replace("{token}", "1"))
    second = make_module("bg_masker_two", MASKER.replace("{token}", "2"))
    check_third_party_clash(load_registry([first, second]), first, second)


def test_third_party_clash_between_an_entry_point_and_a_module(make_module: MakeModule, make_distribution) -> None:
    make_module("bg_masker_one", MASKER.replace("{token}", "1"))
    second = make_module("bg_masker_two", MASKER.replace("{token}", "2"))
    make_distribution("bg-maskers", "0.3", "maskone = bg_masker_one")
    registry = load_registry([second])
    check_third_party_clash(registry, "maskone", second)
    assert masked_token(registry.build_sampler("bg-maskers:masker", {})) == 1  # the distribution's name


def test_a_plugin_registering_one_name_twice_is_named(make_module: MakeModule) -> None:
    name = make_module("bg_twice", MASKER.replace("{token}", "1").replace(
        'return [SamplerSpec("masker"', 'return [SamplerSpec("masker", "again", Options, lambda o: mask), SamplerSpec("masker"'))
    with pytest.raises(PluginError, match=r"^plugin 'bg_twice' \(module\) registers sampler 'masker' twice$"):
        load_registry([name])


# ----------------------------------------------------------------------------- config and CLI

def write_job(tmp_path: Path, model: str, **sections) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(3)), encoding="utf-8")
    job = {"model": {"name": model}, "data": {"source": str(data)}, "output": {"path": str(tmp_path / "out.jsonl")},
           "generation": {"max_tokens": 2}, **sections}
    path = tmp_path / f"job{len(list(tmp_path.glob('job*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def test_config_validation_takes_qualified_names_and_names_a_clash(make_module: MakeModule, tmp_path: Path) -> None:
    one = make_module("bg_masker_one", MASKER.replace("{token}", "1"))
    two = make_module("bg_masker_two", MASKER.replace("{token}", "2"))
    mine = make_module("bg_my_json_valid", JSON_VALID)
    plugins = [one, two, mine]
    clashing = write_job(tmp_path, "m", plugins=plugins, generation={"mode": "sample", "sampler": {"name": "masker"}})
    registry = load_registry(plugin_modules(clashing))
    with pytest.raises(ConfigError) as info:
        load_config(clashing, registry=registry)
    (issue,) = info.value.issues
    assert issue.path == "generation.sampler"
    assert issue.message.startswith("sampler 'masker' is registered by 2 plugins: ")
    assert f"'{one}:masker' or '{two}:masker'" in issue.message
    # --set takes a qualified name, and so do metrics; an unrelated job is not touched by the clash.
    config = load_config(clashing, [f"generation.sampler.name={two}:masker"], registry=registry)
    assert config.generation.sampler.name == f"{two}:masker"
    metrics = [{"name": "batchgen:json_valid"}, {"name": "json_valid", "label": "mine", "options": {"seven": 3}}]
    qualified = load_config(write_job(tmp_path, "m", plugins=plugins, metrics=metrics), registry=registry)
    resolved = resolved_dict(qualified, registry)
    assert [(m["name"], m["label"], m["options"]) for m in resolved["metrics"]] == [
        ("batchgen:json_valid", "batchgen:json_valid", {"allow_code_fence": False}),
        ("json_valid", "mine", {"seven": 3}),
    ]
    with pytest.raises(ConfigError, match=r"metrics\.0: invalid options for metric plugin 'batchgen:json_valid': seven"):
        load_config(write_job(tmp_path, "m", plugins=plugins, metrics=[{"name": "batchgen:json_valid", "options": {"seven": 1}}]),
                    registry=registry)
    load_config(write_job(tmp_path, "m", plugins=plugins), registry=registry)


def _cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "batchgen.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_the_command_line_with_clashing_plugins(make_module: MakeModule, make_distribution, tmp_path: Path,
                                                tiny_model) -> None:
    model = tiny_model("llama")
    make_module("bg_masker_one", MASKER.replace("{token}", "1"))
    two = make_module("bg_masker_two", MASKER.replace("{token}", "2"))
    make_module("bg_my_json_valid", JSON_VALID)
    make_distribution("bg-maskers", "0.3", "maskone = bg_masker_one")
    make_distribution("bg-json-tools", "1.2", "jsontools = bg_my_json_valid")

    # `batchgen plugins` runs, lists every registration and marks each clash.
    listing = _cli(tmp_path, "plugins", "--plugin", two)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    for name, plugin in (("masker", "maskone"), ("masker", two), ("json_valid", "jsontools"),
                         ("json_valid", "batchgen-builtin-metrics")):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{plugin} ("))
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        block = lines[start:end]
        row = next(i for i, line in enumerate(block) if line.split()[1:2] == [name])
        assert block[row + 1].strip().startswith("clash: also registered by "), block
    entries = json.loads(_cli(tmp_path, "plugins", "--json", "--plugin", two).stdout)
    items = {(e["name"], i["name"]): i for e in entries for i in e["samplers"] + e["metrics"]}
    assert items[("jsontools", "json_valid")]["clash"].endswith(
        "the bare name picks this one; 'jsontools:json_valid' always picks this one")
    assert "the bare name picks the one of plugin 'jsontools' from bg-json-tools 1.2" in items[("batchgen-builtin-metrics", "json_valid")]["clash"]
    assert "the bare name is refused" in items[("maskone", "masker")]["clash"]
    assert items[("batchgen-builtin-metrics", "exact_match")]["clash"] is None

    # A job that uses neither clashing name runs its checks as before.
    plain = _cli(tmp_path, "validate", str(write_job(tmp_path, model, plugins=[two])))
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr == ""
    # The bare name of a third-party clash: exit 2, both plugins and the qualified names.
    sampler = {"mode": "sample", "max_tokens": 2, "sampler": {"name": "masker"}}
    bare = _cli(tmp_path, "validate", str(write_job(tmp_path, model, plugins=[two], generation=sampler)))
    assert bare.returncode == 2
    assert bare.stderr.count("\n") == 1 and "Traceback" not in bare.stderr
    assert ("generation.sampler: sampler 'masker' is registered by 2 plugins: plugin 'maskone' from bg-maskers 0.3 and "
            f"plugin '{two}' (module); write one of 'maskone:masker' or '{two}:masker' to choose") in bare.stderr
    chosen = _cli(tmp_path, "validate", str(write_job(tmp_path, model, plugins=[two], generation=sampler)),
                  "--set", "generation.sampler.name=maskone:masker")
    assert chosen.returncode == 0, chosen.stderr
    # The built-in's name: the plugin's metric, one warning line; the qualified built-in, no warning.
    shadowed = _cli(tmp_path, "validate", str(write_job(tmp_path, model, metrics=[{"name": "json_valid"}])))
    assert shadowed.returncode == 0, shadowed.stderr
    assert shadowed.stderr.splitlines() == [
        "batchgen: warning: metric 'json_valid' of plugin 'jsontools' from bg-json-tools 1.2 is used in place of the "
        "built-in one; write 'batchgen:json_valid' for the built-in"
    ]
    builtin = _cli(tmp_path, "validate", str(write_job(tmp_path, model, metrics=[{"name": "batchgen:json_valid"}])))
    assert (builtin.returncode, builtin.stderr) == (0, "")
