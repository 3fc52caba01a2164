"""Real processes: SIGKILL then resume, a second run on a busy output, SIGTERM, and Ctrl-C
pressed again and again.

Each job is started as a child process on the tiny model and the checks run against it while it
works. Off a terminal (stderr is a pipe here) a run says what it is doing with plain log lines
instead of a progress bar.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROWS = 40
SLOW_PLUGIN = (
    "import time\n"
    "from batchgen.plugins import hookimpl\n\n"
    "@hookimpl\n"
    "def batchgen_record_finished(record):\n"
    "    time.sleep(0.25)\n"
)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for_lines(proc: subprocess.Popen, path: Path, count: int) -> None:
    deadline = time.monotonic() + 300
    while _lines(path) < count:
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"fewer than {count} records within 300 s")
        time.sleep(0.02)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _summary(out: Path) -> dict:
    return json.loads(out.with_name("out.summary.json").read_text())


def _job(tmp_path: Path, model: str, rows: int, generation: dict, engine: dict, plugins: list[str]) -> tuple[list[str], Path]:
    """A YAML job over ``rows`` prompts; returns the ``batchgen run`` command and the output."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i:03d}", "prompt": f"Item {i}:"}) + "\n" for i in range(rows)))
    out = tmp_path / "out.jsonl"
    config = {
        "model": {"name": model, "device": "cpu", "dtype": "float32"},
        "data": {"source": str(data), "id_column": "uid"},
        "prompt": {"column": "prompt", "chat_template": False},
        "generation": {"mode": "greedy", "ignore_eos": True, **generation},
        "engine": {"kv_cache_memory": "8MiB", **engine},
        "metrics": [{"name": "length"}],
        "output": {"path": str(out)},
        "plugins": plugins,
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "batchgen.cli", "run", str(job)], out


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_then_resume(tmp_path: Path, tiny_llama: str, sigkill_after_records) -> None:
    """Every id once, the lines written before the kill byte-identical, the lock taken over."""
    rows = 32
    # Two sequences at a time and a fixed length: records land two by two, one wave every 16
    # steps, so the job is still far from done when the first lines appear.
    command, out = _job(tmp_path, tiny_llama, rows, {"max_tokens": 16}, {"max_num_seqs": 2}, [])
    command.append("--quiet")
    killed = sigkill_after_records(command, out)
    assert out.with_name("out.jsonl.lock").exists()  # left behind, and free (see below)
    assert _summary(out)["status"] == "running"  # the one written when the run started

    complete = killed[: killed.rfind(b"\n") + 1]
    written_before = [json.loads(line)["id"] for line in complete.splitlines()]
    assert 3 <= len(written_before) < rows

    # Without a flag the run refuses to touch the file.
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and "--resume" in refused.stderr and "--overwrite" in refused.stderr
    assert out.read_bytes() == killed

    # The resumed run may batch differently; resume only depends on the ids in the file.
    resumed = subprocess.run(
        [*command, "--resume", "--set", "engine.max_num_seqs=32"], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = out.read_bytes()
    assert final.startswith(complete)  # pre-kill records are byte-identical
    records = [json.loads(line) for line in final.splitlines()]  # every line is valid JSON
    ids = [r["id"] for r in records]
    assert sorted(ids) == [f"p{i:03d}" for i in range(rows)]  # every id exactly once
    assert all(r["error"] is None and r["generations"][0]["num_tokens"] == 16 for r in records)
    summary = _summary(out)
    assert summary["status"] == "completed"
    assert summary["records"]["resumed"] == len(written_before)
    assert summary["records"]["this_run"] == rows - len(written_before)
    assert summary["records"]["total"] == rows
    assert [run["status"] for run in summary["runs"]] == ["running", "completed"]  # the killed run, then this one


def test_busy_output_sigterm_and_repeated_ctrl_c(tmp_path: Path, tiny_llama: str) -> None:
    # A plugin that sleeps after each record keeps the run busy while the checks run.
    (tmp_path / "slow_records.py").write_text(SLOW_PLUGIN)
    command, out = _job(tmp_path, tiny_llama, ROWS, {"max_tokens": 4}, {"max_num_seqs": 4}, ["slow_records"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_lines(first, out, 2)
        # A second run on the same output is refused while it works (--overwrite too: see
        # test_cli.py::test_output_in_use_is_refused).
        second = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"output file {out} is in use by pid {first.pid} (started " in second.stderr
        assert first.poll() is None, "the run finished before SIGTERM; make it longer"
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        _reap(first)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"batchgen: error: interrupted by SIGTERM; the summary says 'interrupted'; rerun with --resume to continue ({out})"
    )
    # Off a terminal the run still shows signs of life.
    assert f"batchgen: loading model {tiny_llama}\n" in err and f"batchgen: generating {ROWS} record(s)\n" in err
    summary = _summary(out)
    assert (summary["status"], summary["signal"]) == ("interrupted", "SIGTERM")
    written = _lines(out)
    assert summary["records"]["total"] == written and 2 <= written < ROWS
    assert not out.with_name("out.jsonl.lock").exists()

    # Resume, then press Ctrl-C again and again: one clean stop, no traceback from a finaliser.
    resumed = subprocess.Popen([*command, "--resume", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        _wait_for_lines(resumed, out, written + 1)
        deadline = time.monotonic() + 30
        while resumed.poll() is None and time.monotonic() < deadline:
            try:
                resumed.send_signal(signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        _, err = resumed.communicate(timeout=60)
    finally:
        _reap(resumed)
    assert resumed.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "batchgen: error: interrupted by SIGINT" in err
    summary = _summary(out)
    assert (summary["status"], summary["signal"]) == ("interrupted", "SIGINT")
    lines = out.read_text().splitlines()
    assert summary["records"]["total"] == len(lines) and summary["records"]["resumed"] == written
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids))  # no duplicates across the two runs
    assert [r["status"] for r in summary["runs"]] == ["interrupted", "interrupted"]
