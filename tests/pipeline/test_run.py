"""End-to-end runs on the tiny model, in process: records, summary, resume, bad rows, plugins."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from batchgen.config import load_config, plugin_modules
from batchgen.run.errors import RunFailed
from batchgen.run.execute import execute
from batchgen.run.plan import plan
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
    # Prompt tokens computed: all but those served from the prefix cache.
    cached = sum(r["usage"]["cached_tokens"] for r in records)
    assert summary["throughput"]["prefill_tokens"] == summary["throughput"]["prompt_tokens"] - cached
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


# --------------------------------------------------------------------------- hardening


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    name = f"{name}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_summary_fills_plugin_defaults_labels_and_token_counts(job_config, tiny_llm) -> None:
    summary, records = _run(
        job_config(), tiny_llm, "generation.mode=beam", "generation.beam_width=3", "generation.ignore_eos=true", "data.limit=3"
    )
    exact, length = summary["config"]["metrics"]
    assert exact["label"] == "exact_match" and length["label"] == "length"
    assert exact["options"]["reference"] == "answer" and exact["options"]["lowercase"] is True  # defaults filled
    # Beam search: the engine counts the beams live after each step (pruned ones included, the
    # step that completes a hypothesis not); the records keep the returned beams' tokens. Both
    # are reported, each under its own name (docs/config.md, "Run summary").
    kept = sum(r["usage"]["generated_tokens"] for r in records)
    assert kept == 3 * 3 * 8  # 3 records, 3 beams of max_tokens 8 (EOS ignored)
    assert summary["throughput"]["output_tokens"] == kept
    assert summary["throughput"]["generated_tokens"] == 3 * 3 * 7  # the 8th step completes all three
    assert summary["records"]["total"] == 3 and "first_error" not in summary["records"]


def test_full_disk_mid_run(job_config, tiny_llm, tmp_path: Path, full_disk, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.io.output_file import JsonlWriter

    out = tmp_path / "out" / "results.jsonl"
    elsewhere = tmp_path / "summaries" / "run.summary.json"
    disk = full_disk(out.parent)
    written = []
    real_write = JsonlWriter.write

    def write(self: JsonlWriter, record: dict[str, Any]) -> None:
        if len(written) == 3:
            disk.left = 40  # the disk fills up in the middle of the fourth line
        real_write(self, record)
        written.append(record["id"])

    monkeypatch.setattr(JsonlWriter, "write", write)
    # The summary lives on another disk: it is written, and says what happened.
    path = job_config(output={"path": str(out), "summary_path": str(elsewhere)})
    with pytest.raises(RunFailed) as info:
        _run(path, tiny_llm)
    assert str(info.value) == f"cannot write to {out}: no space left on device"
    assert out.read_bytes().endswith(b"\n") and len(_read(out)) == 3  # valid JSONL, nothing torn
    summary = json.loads(elsewhere.read_text())
    assert summary["status"] == "failed" and summary["error"] == str(info.value)
    assert summary["records"]["total"] == summary["records"]["this_run"] == 3

    # The summary on the full disk too: the error says it could not be written.
    written.clear()
    disk.left = None
    path = job_config(output={"path": str(out), "if_exists": "overwrite"})
    with pytest.raises(RunFailed) as info:
        _run(path, tiny_llm)
    summary_file = out.parent / "results.summary.json"
    assert str(info.value) == (
        f"cannot write to {out}: no space left on device; also, the summary could not be written: "
        f"cannot write {summary_file}: no space left on device"
    )
    assert len(_read(out)) == 3
    assert json.loads(summary_file.read_text())["status"] == "running"  # the start's, whole


HOOKS = """
from batchgen.plugins import hookimpl

@hookimpl
def {hook}({arg}):
    {body}
"""


@pytest.mark.parametrize("hook,arg,body,status", [
    ("batchgen_run_end", "summary", "raise RuntimeError('upload failed')", "completed"),
    ("batchgen_record_finished", "record", "raise RuntimeError('upload failed')", "failed"),
])
def test_failing_hook_is_named_and_recorded(job_config, tiny_llm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            hook: str, arg: str, body: str, status: str) -> None:
    name = _module(tmp_path, monkeypatch, "hooky", HOOKS.format(hook=hook, arg=arg, body=body))
    path = job_config(plugins=[name], data={"limit": 3})
    with pytest.raises(RunFailed) as info:
        _run(path, tiny_llm)
    expected = f"plugin '{name}' (module) failed in {hook}: RuntimeError: upload failed"
    assert str(info.value).startswith(expected)
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    assert summary["status"] == status and summary["hook_errors"] == [expected]
    written = len(_read(tmp_path / "out" / "results.jsonl"))
    assert summary["records"]["total"] == written == (3 if status == "completed" else 1)
    if status == "completed":
        assert str(info.value) == f"{expected}; the run itself completed (3 records in {tmp_path / 'out' / 'results.jsonl'})"


BAD_SAMPLER = """
from typing import Literal
from pydantic import BaseModel
from batchgen.plugins import SamplerSpec, hookimpl


class Options(BaseModel):
    value: Literal["nan", "inf"] = "nan"


class Poison:
    def __init__(self, value):
        self.value = float(value)

    def __call__(self, logits, output_token_ids):
        logits[-1, 7] = self.value
        return logits


@hookimpl
def batchgen_register_samplers():
    return [SamplerSpec("poison", "writes a NaN or +inf logit", Options, lambda o: Poison(o.value))]
"""


def test_nan_or_inf_logits_from_a_sampler_plugin_fail_the_run(job_config, tiny_llm, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    name = _module(tmp_path, monkeypatch, "poison", BAD_SAMPLER)
    path = job_config(plugins=[name], data={"limit": 2},
                      generation={"mode": "sample", "n": 2, "sampler": {"name": "poison"}})
    with pytest.raises(RunFailed, match=rf"^sampler 'poison' \(plugin '{name}' \(module\)\) returned NaN logits in row\(s\) \[\d+\]"):
        _run(path, tiny_llm)
    with pytest.raises(RunFailed, match=r"returned \+inf logits"):
        _run(path, tiny_llm, "generation.sampler.options.value=inf", "output.if_exists=overwrite")
    assert _read(tmp_path / "out" / "results.jsonl") == []  # no garbage record was written


def test_resume_refuses_a_changed_config_unless_forced(job_config, tiny_llm, tmp_path: Path) -> None:
    from batchgen.run.errors import ResumeMismatchError

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    out = tmp_path / "out" / "results.jsonl"
    before = out.read_bytes()

    def plan_resume(*overrides: str, force: bool = False):
        registry = load_registry()
        config = load_config(path, ["output.if_exists=resume", *overrides], registry=registry)
        return plan(config, registry, force_resume=force)

    with pytest.raises(ResumeMismatchError) as info:
        plan_resume("generation.mode=beam", "generation.beam_width=2", "generation.max_tokens=4")
    message = str(info.value)
    assert message.startswith(f"cannot resume {out}: its records were written with a different config")
    assert "  - generation.max_tokens: 8 before, 4 now\n" in message and '  - generation.mode: "greedy" before, "beam" now' in message
    assert "--force-resume" in message and out.read_bytes() == before
    # What only changes speed or which rows are taken is not a difference.
    plan_resume("engine.max_num_seqs=2", "engine.block_size=8", "data.limit=6").release()
    job = plan_resume("generation.max_tokens=4", force=True)
    summary = execute(job, quiet=True, llm=tiny_llm)
    assert summary["records"]["total"] == 12 and summary["records"]["resumed"] == 4
    assert len(summary["runs"]) == 2 and summary["fingerprint"] != json.loads(before.splitlines()[0]).get("fingerprint")


def test_interrupt_counts_what_is_in_the_file(job_config, tiny_llama: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal right after a record is written, before the run's own bookkeeping: the summary
    still counts that record (it is read back from the file)."""
    from batchgen import LLM
    from batchgen.io.output_file import JsonlWriter
    from batchgen.run.errors import Interrupted

    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory=8 * 2**20, max_num_seqs=4)
    real_write = JsonlWriter.write
    count = [0]

    def write(self: JsonlWriter, record: dict[str, Any]) -> None:
        real_write(self, record)
        count[0] += 1
        if count[0] == 3:
            raise Interrupted(15)  # SIGTERM lands between the write and the counters

    monkeypatch.setattr(JsonlWriter, "write", write)
    with pytest.raises(Interrupted):
        _run(job_config(), llm)
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    assert (summary["status"], summary["signal"]) == ("interrupted", "SIGTERM")
    assert summary["records"]["total"] == summary["records"]["this_run"] == 3 == len(_read(tmp_path / "out" / "results.jsonl"))


def test_resume_checks_the_config_kept_beside_the_records(job_config, tiny_llm, tmp_path: Path) -> None:
    """The records' config lives in ``<output>.resume.json``: a changed config is refused even
    with the summary deleted or moved, and records with no config at all need --force-resume."""
    from batchgen.run.errors import ResumeMismatchError
    from batchgen.run.fingerprint import sidecar_path

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    out = tmp_path / "out" / "results.jsonl"
    sidecar = sidecar_path(out)
    assert sidecar == tmp_path / "out" / "results.jsonl.resume.json"
    assert json.loads(sidecar.read_text())["fingerprint"] == json.loads(
        (tmp_path / "out" / "results.summary.json").read_text())["fingerprint"]
    before = out.read_bytes()

    def plan_resume(*overrides: str, force: bool = False):
        registry = load_registry()
        config = load_config(path, ["output.if_exists=resume", *overrides], registry=registry)
        return plan(config, registry, force_resume=force)

    (tmp_path / "out" / "results.summary.json").unlink()
    for moved in ((), (f"output.summary_path={tmp_path / 'elsewhere.json'}",)):
        with pytest.raises(ResumeMismatchError, match=r"  - generation.max_tokens: 8 before, 4 now") as info:
            plan_resume("generation.max_tokens=4", *moved)
        assert f"(from {sidecar})" in str(info.value)
    plan_resume().release()  # the same config resumes
    sidecar.unlink()
    with pytest.raises(ResumeMismatchError, match=r"nothing says which config its records were written with"):
        plan_resume()
    assert out.read_bytes() == before
    job = plan_resume(force=True)  # forced: appends, and keeps this run's config beside the records
    summary = execute(job, quiet=True, llm=tiny_llm)
    assert summary["records"]["total"] == 12 and summary["records"]["resumed"] == 4
    assert json.loads(sidecar.read_text())["fingerprint"] == summary["fingerprint"]


def test_a_chat_message_with_an_unknown_role_becomes_an_error_record(job_config, tiny_llm, tmp_path: Path) -> None:
    rows = [{"qid": "ok", "messages": [{"role": "user", "content": "Hi"}]},
            {"qid": "bad", "messages": [{"role": "wizard", "content": "Zap"}]}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = job_config(data={"source": str(data), "id_column": "qid"}, prompt={"column": "messages", "template": None, "chat_template": True},
                      metrics=[])
    summary, records = _run(path, tiny_llm)
    by_id = {r["id"]: r for r in records}
    assert by_id["ok"]["error"] is None and by_id["ok"]["generations"]
    assert by_id["bad"]["error"] == "column 'messages': message 0 has role 'wizard'; expected one of 'system', 'user', 'assistant'"
    assert by_id["bad"]["generations"] == [] and summary["records"]["error"] == 1


def test_the_summary_records_batchgen_threads(job_config, tiny_llm) -> None:
    """``threads`` is the engine's own thread count (its C kernels' pool), not torch's one thread."""
    import torch

    from batchgen.threads import resolve_num_threads

    summary, _ = _run(job_config(), tiny_llm, "data.limit=2")
    line = summary["executor"]["per_replica"][0]
    assert line["threads"] == resolve_num_threads(tiny_llm.config.num_threads)
    assert line["torch_threads"] == torch.get_num_threads()


def _plan_resume(path: Path, *overrides: str, force: bool = False):
    registry = load_registry()
    config = load_config(path, ["output.if_exists=resume", *overrides], registry=registry)
    return plan(config, registry, force_resume=force)


def test_a_resume_refuses_another_quantization_backend_or_device(job_config, tiny_llm, tmp_path: Path) -> None:
    """Every setting that changes bits is fingerprinted (tests/unit/test_fingerprint.py walks
    the schema); here the ones the second round's probe found missing."""
    from batchgen.run.errors import ResumeMismatchError

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    cases = {"engine.quantization=none": 'engine.quantization: "auto" before, "none" now',
             "engine.attention_backend=torch": 'engine.attention_backend: "auto" before, "torch" now',
             "engine.linear_backend=torch": 'engine.linear_backend: "auto" before, "torch" now',
             "model.device=auto": 'model.device: "cpu" before, "auto" now',
             "data.format=json": 'data.format: "auto" before, "json" now'}
    for override, expected in cases.items():
        with pytest.raises(ResumeMismatchError) as info:
            _plan_resume(path, override)
        assert f"  - {expected}\n" in str(info.value), str(info.value)
    _plan_resume(path).release()  # the same settings resume
    assert len(_read(tmp_path / "out" / "results.jsonl")) == 4


def test_a_damaged_or_empty_sidecar_does_not_pass(job_config, tiny_llm, tmp_path: Path) -> None:
    """Damaged is said as damaged, not 'missing'; ``{"config": {}}`` lists every key as a
    difference; and a refused resume leaves the file as it was, torn tail included."""
    from batchgen.run.errors import ResumeMismatchError

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    out = tmp_path / "out" / "results.jsonl"
    sidecar = tmp_path / "out" / "results.jsonl.resume.json"
    with out.open("ab") as handle:
        handle.write(b'{"id": "q04", "outp')  # the torn tail of a killed run
    torn = out.read_bytes()
    cases = {"{not json": f"cannot resume {out}: {sidecar} is damaged: not valid JSON (",
             "[1, 2]": f"cannot resume {out}: {sidecar} is damaged: it holds no 'config' object",
             '{"config": {}}': "  - data.source: (not recorded) before",  # an older sidecar: defaults fill in
             '{"version": 2, "config": {}}': '  - engine.quantization: (not recorded) before, "auto" now\n'}
    for text, expected in cases.items():
        sidecar.write_text(text)
        with pytest.raises(ResumeMismatchError) as info:
            _plan_resume(path)
        message = str(info.value)
        assert expected in message and "is missing" not in message, message
        assert out.read_bytes() == torn and sidecar.read_text() == text
    with pytest.raises(ResumeMismatchError, match=r"(?s)generation.max_tokens: \(not recorded\) before, 8 now.*"
                       r"model.name: \(not recorded\) before"):
        sidecar.write_text('{"version": 2, "config": {}}')
        _plan_resume(path)
    job = _plan_resume(path, force=True)  # forced: the torn tail goes, the four records stay
    job.release()
    assert out.read_bytes() == torn[: torn.rindex(b"\n") + 1] and len(job.answered) == 4


def test_a_sidecar_of_an_older_batchgen_still_resumes(job_config, tiny_llm, tmp_path: Path) -> None:
    """An upgrade does not refuse a resume: the sidecar an older batchgen wrote (no version, no
    dataset digest, none of the settings added since) resumes with the same config, since those
    settings are at their defaults; one now set otherwise is still a difference."""
    import json

    from batchgen.run.errors import ResumeMismatchError

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    sidecar = tmp_path / "out" / "results.jsonl.resume.json"
    kept = json.loads(sidecar.read_text())
    for key in ("tokenizer", "max_model_len", "max_logprobs", "tensor_parallel_size", "gpu_memory_utilization"):
        kept["config"]["engine"].pop(key)
    sidecar.write_text(json.dumps({"fingerprint": kept["fingerprint"], "config": kept["config"]}))
    _plan_resume(path).release()
    sidecar.write_text(json.dumps({"fingerprint": kept["fingerprint"], "config": kept["config"]}))
    with pytest.raises(ResumeMismatchError, match=r"engine.max_model_len: null before, 64 now"):
        _plan_resume(path, "engine.max_model_len=64")


def test_a_refused_resume_of_a_damaged_file_changes_nothing(job_config, tiny_llm, tmp_path: Path) -> None:
    from batchgen.io.output_file import OutputError

    path = job_config()
    _run(path, tiny_llm, "data.limit=4")
    out = tmp_path / "out" / "results.jsonl"
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(lines[0] + b"not json\n" + b"".join(lines[1:]) + b'{"id": "q9')
    damaged = out.read_bytes()
    with pytest.raises(OutputError, match=r"line 2: not valid JSON"):
        _plan_resume(path)
    assert out.read_bytes() == damaged


def test_a_resume_refuses_a_dataset_changed_in_place(job_config, tiny_llm, tmp_path: Path, qa_file: Path) -> None:
    """Same path, other rows: refused (the sidecar keeps the file's size and hash)."""
    from batchgen.run.errors import ResumeMismatchError

    data = tmp_path / "qa.jsonl"
    data.write_bytes(qa_file.read_bytes())
    path = job_config(data={"source": str(data)})
    _run(path, tiny_llm, "data.limit=4")
    kept = json.loads((tmp_path / "out" / "results.jsonl.resume.json").read_text())["dataset"]
    assert kept["bytes"] == data.stat().st_size and len(kept["sha256"]) == 32
    os.utime(data, (1, 1))  # touched, or copied: the same content still resumes
    _plan_resume(path).release()
    edited = data.read_bytes().replace(b"What is 5 plus 5?", b"What is 5 plus 6?")
    data.write_bytes(edited)
    with pytest.raises(ResumeMismatchError) as info:
        _plan_resume(path)
    assert (f"  - the dataset at data.source {data}: {kept['bytes']} bytes, sha256 {kept['sha256'][:12]} before, "
            f"{len(edited)} bytes, sha256 ") in str(info.value)
    assert "(the file changed since these records were written)" in str(info.value)
