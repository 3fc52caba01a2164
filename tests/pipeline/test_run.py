"""End-to-end runs on the tiny model, in process: records, summary, resume, bad rows, plugins."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from batchgen.config import load_config, plugin_modules
from batchgen.pipeline import RunFailed, execute, plan
from batchgen.plugins import load_registry


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(path: Path, llm: Any, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    registry = load_registry(plugin_modules(path, overrides))
    config = load_config(path, overrides, registry=registry)
    summary = execute(plan(config, registry, config_path=str(path)), quiet=True, llm=llm)
    return summary, _read(Path(config.output.path))


def test_greedy_run_writes_records_and_summary(job_config, tiny_llm) -> None:
    from batchgen import SamplingParams

    path = job_config()
    summary, records = _run(path, tiny_llm)
    assert sorted(r["id"] for r in records) == [f"q{i:02d}" for i in range(12)]
    by_id = {r["id"]: r for r in records}
    record = by_id["q03"]
    assert record["prompt"] == "Q: What is 3 plus 3?\nA:" and record["index"] == 3 and record["error"] is None
    (gen,) = record["generations"]
    # The record holds exactly what the engine generates for this prompt on its own.
    ids = tiny_llm.tokenizer(record["prompt"])["input_ids"]
    (expected,) = tiny_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8))
    assert gen["text"] == expected.outputs[0].text
    assert gen["num_tokens"] == len(expected.outputs[0].token_ids) <= 8
    assert gen["finish_reason"] in ("stop", "length") and isinstance(gen["cumulative_logprob"], float)
    assert record["usage"]["prompt_tokens"] == len(ids)
    assert record["usage"]["generated_tokens"] == gen["num_tokens"]
    assert set(record["metrics"]) == {"exact_match", "length"}
    assert record["metrics"]["length"]["tokens"] == gen["num_tokens"]

    assert summary["status"] == "completed"
    assert summary["records"]["total"] == 12 and summary["records"]["ok"] == 12 and summary["records"]["error"] == 0
    assert summary["config"]["generation"]["max_tokens"] == 8 and summary["config_file"] == str(path)
    assert summary["metrics"]["length"]["tokens_mean"] == pytest.approx(
        sum(r["generations"][0]["num_tokens"] for r in records) / 12
    )
    assert set(summary["metrics"]["exact_match"]) >= {"first", "any"}
    # Only this run's tokens (the shared engine counted earlier runs too); EOS is counted, not kept.
    kept = sum(r["usage"]["generated_tokens"] for r in records)
    assert kept <= summary["throughput"]["generated_tokens"] <= kept + len(records)
    assert summary["throughput"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in records)
    assert summary["throughput"]["generated_tokens_per_s"] > 0
    assert {"num_blocks", "peak_blocks_used", "prefix_cache_hit_rate", "saving"} <= set(summary["engine"])
    on_disk = json.loads((path.parent / "out" / "results.summary.json").read_text())
    assert on_disk["records"] == summary["records"] and on_disk["status"] == "completed"


def test_sample_and_beam_modes(job_config, tiny_llm) -> None:
    _, records = _run(job_config(), tiny_llm, "generation.mode=sample", "generation.n=3", "generation.temperature=1.0", "data.limit=3")
    assert len(records) == 3
    for record in records:
        assert [g["index"] for g in record["generations"]] == [0, 1, 2]
        assert "score" not in record["generations"][0]
        assert record["usage"]["generated_tokens"] == sum(g["num_tokens"] for g in record["generations"])
    _, records = _run(
        job_config(), tiny_llm, "generation.mode=beam", "generation.beam_width=2", "data.limit=2", "output.if_exists=overwrite"
    )
    assert len(records) == 2
    for record in records:
        assert [g["index"] for g in record["generations"]] == [0, 1]
        scores = [g["score"] for g in record["generations"]]
        assert all(isinstance(s, float) for s in scores) and scores[0] >= scores[1]


def test_bad_rows_become_error_records_and_the_job_goes_on(job_config, tiny_llm, tmp_path: Path) -> None:
    rows = [
        {"qid": "ok-1", "question": "Short one?", "topic": "math"},
        {"qid": "no-topic", "question": "Another?", "topic": None},
        {"qid": "too-long", "question": "word " * 300, "topic": "long"},
        {"qid": "ok-2", "question": "Last?", "topic": "art"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = job_config(
        data={"source": str(data), "id_column": "qid"},
        prompt={"template": "[{{ topic.upper() }}] {{ question }}", "chat_template": False},
        metrics=[{"name": "length"}],
    )
    summary, records = _run(path, tiny_llm)
    by_id = {r["id"]: r for r in records}
    assert sorted(by_id) == ["no-topic", "ok-1", "ok-2", "too-long"]
    assert by_id["no-topic"]["error"] == "prompt template failed: UndefinedError: 'None' has no attribute 'upper'"
    assert by_id["no-topic"]["generations"] == [] and by_id["no-topic"]["metrics"] == {}
    long_error = by_id["too-long"]["error"]
    n = by_id["too-long"]["usage"]["prompt_tokens"]
    assert long_error == (
        f"prompt too long: {n} tokens + generation.max_tokens=8 exceeds the model's context length of 256 tokens"
    )
    assert by_id["ok-1"]["error"] is None and by_id["ok-1"]["prompt"] == "[MATH] Short one?"
    assert by_id["ok-2"]["error"] is None and len(by_id["ok-2"]["generations"]) == 1
    assert (summary["records"]["ok"], summary["records"]["error"]) == (2, 2)
    # Metrics aggregate over the records that have generations only.
    assert summary["metrics"]["length"]["tokens_mean"] == pytest.approx(
        (by_id["ok-1"]["generations"][0]["num_tokens"] + by_id["ok-2"]["generations"][0]["num_tokens"]) / 2
    )


def test_resume_skips_written_ids_and_keeps_lines(job_config, tiny_llm) -> None:
    path = job_config()
    _, first = _run(path, tiny_llm, "data.limit=5")
    out = path.parent / "out" / "results.jsonl"
    before = out.read_bytes()
    with open(out, "ab") as f:
        f.write(b'{"id": "q07", "prompt": "torn')  # a line cut by a crash
    summary, records = _run(path, tiny_llm, "output.if_exists=resume")
    assert out.read_bytes().startswith(before)
    ids = [r["id"] for r in records]
    assert sorted(ids) == [f"q{i:02d}" for i in range(12)] and len(set(ids)) == 12
    assert (summary["records"]["resumed"], summary["records"]["this_run"], summary["records"]["total"]) == (5, 7, 12)
    # The aggregate covers the whole file, resumed records included.
    assert summary["metrics"]["length"]["tokens_mean"] == pytest.approx(
        sum(r["generations"][0]["num_tokens"] for r in records) / 12
    )
    # Greedy output does not depend on what ran beside it: the resumed records match a fresh run.
    done, fresh = _run(path, tiny_llm, "output.if_exists=overwrite")
    def texts(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
        return {r["id"]: [(g["text"], g["num_tokens"]) for g in r["generations"]] for r in rows}

    assert texts(fresh) == texts(records)
    # Resuming a finished run has nothing to do and does not even load the model; the summary
    # keeps the figures of the run that did the work and adds its own to the history.
    summary, again = _run(path, None, "output.if_exists=resume")
    assert again == fresh
    assert (summary["records"]["this_run"], summary["records"]["total"], summary["status"]) == (0, 12, "completed")
    assert summary["throughput"] == done["throughput"] and summary["throughput"]["generated_tokens"] > 0
    assert summary["timings"] == done["timings"] and summary["engine"] == done["engine"]
    assert len(summary["runs"]) == 2 and summary["runs"][0] == done["runs"][-1]
    noop = summary["runs"][-1]
    assert noop["records"]["this_run"] == 0 and "load_model_s" not in noop["timings"]
    assert noop["throughput"]["generated_tokens"] == 0


PLUGIN = '''
from pydantic import BaseModel, ConfigDict
from batchgen.plugins import MetricSpec, hookimpl

EVENTS = []


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail_on: str = ""


class Flaky:
    name = "flaky"

    def __init__(self, options):
        self.fail_on = options.fail_on

    def score(self, record, row):
        if record["id"] == self.fail_on:
            raise RuntimeError("cannot score this one")
        return {"chars": len(record["generations"][0]["text"])}

    def aggregate(self, scores):
        return {"n": float(len(scores))}


@hookimpl
def batchgen_register_metrics():
    return [MetricSpec("flaky", "fails on one record", Options, Flaky)]


@hookimpl
def batchgen_run_start(config):
    EVENTS.append(("start", config["output"]["path"]))


@hookimpl
def batchgen_record_finished(record):
    EVENTS.append(("record", record["id"]))


@hookimpl
def batchgen_run_end(summary):
    EVENTS.append(("end", summary["status"]))
'''


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"flaky_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_plugin_metric_crash_names_the_plugin_and_hooks_fire(job_config, tiny_llm, plugin_module: str) -> None:
    path = job_config(
        plugins=[plugin_module],
        metrics=[{"name": "flaky", "options": {"fail_on": "q02"}}],
        data={"limit": 4},
    )
    summary, records = _run(path, tiny_llm)
    by_id = {r["id"]: r for r in records}
    error = by_id["q02"]["error"]
    assert error.startswith("metric 'flaky'") and plugin_module in error
    assert "failed on record 'q02': RuntimeError: cannot score this one" in error
    assert len(by_id["q02"]["generations"]) == 1  # the generation is kept
    assert by_id["q01"]["metrics"]["flaky"]["chars"] == len(by_id["q01"]["generations"][0]["text"])
    assert summary["metrics"]["flaky"] == {"n": 3.0}
    events = sys.modules[plugin_module].EVENTS
    assert events[0] == ("start", str(path.parent / "out" / "results.jsonl"))
    assert sorted(e[1] for e in events[1:-1]) == ["q00", "q01", "q02", "q03"]
    assert events[-1] == ("end", "completed")


def test_third_party_sampler_plugin_from_yaml(job_config, tiny_llm) -> None:
    registry = load_registry()
    (entry,) = [e for e in registry.describe() if any(s["name"] == "typical" for s in e["samplers"])]
    assert entry["source"] == "entry point" and entry["distribution"] == "batchgen-typical"
    path = job_config(
        generation={"mode": "sample", "n": 2, "temperature": 1.0, "sampler": {"name": "typical", "options": {"mass": 0.5}}},
        data={"limit": 3},
    )
    summary, records = _run(path, tiny_llm)
    assert summary["status"] == "completed" and len(records) == 3
    assert all(r["error"] is None and len(r["generations"]) == 2 for r in records)
    # The resolved config fills the plugin's option defaults.
    assert summary["config"]["generation"]["sampler"] == {"name": "typical", "options": {"mass": 0.5, "min_tokens_to_keep": 1}}


def test_hook_crash_fails_the_run_naming_the_plugin(job_config, tiny_llm, plugin_module: str, tmp_path: Path) -> None:
    module = tmp_path / "crashy_start.py"
    module.write_text(
        "from batchgen.plugins import hookimpl\n\n@hookimpl\ndef batchgen_run_start(config):\n    raise ValueError('no thanks')\n"
    )
    path = job_config(plugins=["crashy_start"])
    with pytest.raises(RunFailed, match=r"crashy_start.*batchgen_run_start: ValueError: no thanks"):
        _run(path, tiny_llm)
    summary = json.loads((path.parent / "out" / "results.summary.json").read_text())
    assert summary["status"] == "failed" and "no thanks" in summary["error"]


def test_interrupt_leaves_valid_lines_and_an_interrupted_summary(job_config, tiny_llama: str, tmp_path: Path) -> None:
    from batchgen import LLM

    # Its own engine: an interrupted stream leaves requests behind in the engine it ran on.
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory=8 * 2**20, max_num_seqs=4)
    (tmp_path / "stop_after_two.py").write_text(
        "from batchgen.plugins import hookimpl\n\nSEEN = []\n\n"
        "@hookimpl\ndef batchgen_record_finished(record):\n"
        "    SEEN.append(record['id'])\n"
        "    if len(SEEN) == 2:\n        raise KeyboardInterrupt\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        path = job_config(plugins=["stop_after_two"])
        with pytest.raises(KeyboardInterrupt):
            _run(path, llm)
    finally:
        sys.path.remove(str(tmp_path))
    records = _read(path.parent / "out" / "results.jsonl")
    assert len(records) == 2
    summary = json.loads((path.parent / "out" / "results.summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["records"]["this_run"] == 2
