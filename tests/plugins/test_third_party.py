"""Acceptance: the example plugins in plugins/, once pip-installed, are found through their
``batchgen`` entry points and used from a YAML run config.

CI installs them with ``pip install -e plugins/batchgen-typical -e plugins/batchgen-humaneval``.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen.config import ConfigError, load_config, plugin_modules
from batchgen.plugins import load_registry

PACKAGES = {"batchgen-typical": ("typical", "batchgen_typical"), "batchgen-humaneval": ("humaneval", "batchgen_humaneval")}


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    missing = []
    for dist in PACKAGES:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:  # fail, not skip: this is the acceptance test of the third-party path
        pytest.fail(
            "plugin packages not installed: " + ", ".join(missing)
            + "; run: pip install " + " ".join(f"-e plugins/{d}" for d in missing),
            pytrace=False,
        )


def test_entry_points_are_declared_by_the_distributions() -> None:
    for dist, (ep_name, module) in PACKAGES.items():
        eps = [ep for ep in importlib.metadata.distribution(dist).entry_points if ep.group == "batchgen"]
        assert [(ep.name, ep.value) for ep in eps] == [(ep_name, module)]


def test_registry_finds_the_plugins_through_their_entry_points() -> None:
    registry = load_registry()
    described = {entry["name"]: entry for entry in registry.describe()}
    typical, humaneval = described["typical"], described["humaneval"]
    assert (typical["source"], typical["distribution"], typical["version"], typical["module"]) == (
        "entry point", "batchgen-typical", "0.1.0", "batchgen_typical",
    )
    assert [s["name"] for s in typical["samplers"]] == ["typical", "eta"] and typical["metrics"] == []
    assert (humaneval["source"], humaneval["distribution"], humaneval["version"]) == (
        "entry point", "batchgen-humaneval", "0.1.0",
    )
    assert [m["name"] for m in humaneval["metrics"]] == ["pass_at_k"]
    assert registry.pm.get_plugin("typical") is sys.modules["batchgen_typical"]
    # pluggy's own record of where each entry-point plugin came from agrees.
    distinfo = {plugin: dist.project_name for plugin, dist in registry.pm.list_plugin_distinfo()}
    assert distinfo[sys.modules["batchgen_typical"]] == "batchgen-typical"
    assert distinfo[sys.modules["batchgen_humaneval"]] == "batchgen-humaneval"
    # Naming an entry-point module in the config's plugins list again registers it once.
    again = load_registry(["batchgen_typical"])
    assert [e["name"] for e in again.describe()].count("typical") == 1
    assert "batchgen_typical" not in [e["name"] for e in again.describe()]


OBSERVER = """
from batchgen.plugins import hookimpl
SEEN = []
@hookimpl
def batchgen_run_start(config):
    SEEN.append(config["generation"]["sampler"]["name"])
"""

CONFIG = """
model:
  name: smollm2-135m-instruct
data:
  source: {data}
  id_column: task_id
prompt:
  column: prompt
  chat_template: false
generation:
  mode: sample
  n: 4
  temperature: 1.0
  max_tokens: 64
  sampler:
    name: typical
    options:
      mass: {mass}
metrics:
  - name: pass_at_k
    options:
      k: [1, 2]
      timeout_s: 3
      memory_mb: 256
  - name: exact_match
    label: exact
    options:
      reference: canonical_solution
output:
  path: {out}
plugins: [bg_yaml_observer]
"""


def test_plugins_used_from_yaml(tmp_path: Path, make_module: Callable[[str, str], str]) -> None:
    from batchgen.sampling.params import SamplingParams
    from batchgen.sampling.sampler import Sampler, SamplingRow
    from batchgen_humaneval.data import load_problems

    make_module("bg_yaml_observer", OBSERVER)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(line for line in (humaneval_lines(2))), encoding="utf-8")
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(data=data, mass=0.5, out=tmp_path / "out.jsonl"), encoding="utf-8")

    registry = load_registry(plugin_modules(path))
    config = load_config(path, registry=registry)
    registry.notify("batchgen_run_start", config=config.model_dump(mode="json"))
    assert sys.modules["bg_yaml_observer"].SEEN == ["typical"]

    # The sampler from YAML, inside the engine's sampler: with p = [.4, .3, .2, .1] and mass 0.5
    # locally typical sampling keeps tokens 1 and 2 only (worked out in test_typical.py).
    sampler_ref = config.generation.sampler
    proc = registry.build_sampler(sampler_ref.name, sampler_ref.options)
    params = SamplingParams(n=1, temperature=config.generation.temperature, logits_processors=[proc])
    rows = [SamplingRow(params, [0], [], torch.Generator().manual_seed(seed)) for seed in range(200)]
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(len(rows), 1)
    drawn = Sampler()(logits, rows).token_ids
    assert set(drawn) == {1, 2}
    # Unmasked tokens keep their relative odds: token 1 (0.3) versus token 2 (0.2) is 60/40.
    assert 0.45 < drawn.count(1) / len(drawn) < 0.75

    # The metrics from YAML score records: the canonical solutions pass, "return None" fails.
    metrics = {ref.key: registry.build_metric(ref.name, ref.options) for ref in config.metrics}
    assert set(metrics) == {"pass_at_k", "exact"}
    problems = load_problems(data)
    for problem in problems:
        texts = [problem["canonical_solution"], "    return None\n", problem["canonical_solution"], "    pass\n"]
        record = {"id": problem["task_id"], "generations": [{"text": t, "finish_reason": "stop"} for t in texts]}
        scores = metrics["pass_at_k"].score(record, problem)
        assert (scores["num_correct"], scores["pass@1"]) == (2, 0.5)
        assert scores["pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(4, 2))
        assert metrics["exact"].score(record, problem) == {"first": True, "any": True, "mean": 0.5}


def test_bad_plugin_options_in_yaml_are_reported(tmp_path: Path, make_module: Callable[[str, str], str]) -> None:
    make_module("bg_yaml_observer", OBSERVER)
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(data=tmp_path / "d.jsonl", mass=1.5, out=tmp_path / "o.jsonl"), encoding="utf-8")
    registry = load_registry(plugin_modules(path))
    with pytest.raises(ConfigError) as info:
        load_config(path, registry=registry)
    message = str(info.value)
    assert "generation.sampler" in message and "typical" in message and "mass" in message


def humaneval_lines(count: int) -> list[str]:
    """The first ``count`` HumanEval problems as JSONL lines."""
    import json

    from batchgen_humaneval.data import load_problems

    return [json.dumps(p) + "\n" for p in load_problems(limit=count)]
