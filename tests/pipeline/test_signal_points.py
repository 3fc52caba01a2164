"""Real processes: a signal at each point of a short run, and the exit status, the message and the
summary's status agree every time.

A test-only plugin (written to the test's folder and listed under ``plugins:``) pauses the run
at one point (``POINT``): when the run starts, after record K, during the final summary write,
or in ``batchgen_run_end``. It says so with a file, the test sends the signal, then lets the run
go on. A run whose records are all written is ``completed`` (exit 0) whenever the signal lands;
one that is not is ``interrupted`` (exit 128 + the signal). No traceback ever reaches stderr.
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

ROWS = 4

PAUSE_PLUGIN = '''
import os, time
from pathlib import Path

import batchgen.run.summary as summary_module
from batchgen.plugins import hookimpl

POINT = os.environ["PAUSE_POINT"]
READY, GO = Path(os.environ["PAUSE_READY"]), Path(os.environ["PAUSE_GO"])
seen = [0]


def pause(point):
    if point != POINT:
        return
    READY.write_text(point)
    deadline = time.monotonic() + 60
    while not GO.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


@hookimpl
def batchgen_run_start(config):
    pause("start")


@hookimpl
def batchgen_record_finished(record):
    seen[0] += 1
    pause(f"record:{seen[0]}")


@hookimpl
def batchgen_run_end(summary):
    pause("end")


real_write = summary_module.write_json_atomic


def write_json_atomic(path, data):
    if data.get("status") != "running":
        pause("summary")  # the final summary, before it reaches the file
    real_write(path, data)


summary_module.write_json_atomic = write_json_atomic
'''


def _job(tmp_path: Path, model: str) -> tuple[list[str], Path]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i}", "prompt": f"Item {i}:"}) + "\n" for i in range(ROWS)))
    (tmp_path / "pause_points.py").write_text(PAUSE_PLUGIN)
    out = tmp_path / "out.jsonl"
    config = {
        "model": {"name": model, "device": "cpu", "dtype": "float32"},
        "data": {"source": str(data), "id_column": "uid"},
        "prompt": {"column": "prompt", "chat_template": False},
        "generation": {"mode": "greedy", "ignore_eos": True, "max_tokens": 3},
        "engine": {"kv_cache_memory": "8MiB", "max_num_seqs": 1},  # one record at a time
        "output": {"path": str(out)},
        "plugins": ["pause_points"],
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"], out


# (pause point, signal, whether every record is written by then)
POINTS = [
    ("start", signal.SIGTERM, False),  # before the first record (the model is not loaded yet)
    ("record:1", signal.SIGINT, False),  # between records
    (f"record:{ROWS}", signal.SIGTERM, True),  # right after the last record
    ("summary", signal.SIGTERM, True),  # during the final summary write
    ("end", signal.SIGINT, True),  # after the summary, in the last hook
]


def test_exit_status_message_and_summary_agree(tmp_path: Path, tiny_llama: str) -> None:
    """The runs go side by side (each is mostly Python's imports), each paused at its point."""
    runs = []
    for n, (point, sig, complete) in enumerate(POINTS):
        folder = tmp_path / f"run{n}"
        folder.mkdir()
        command, out = _job(folder, tiny_llama)
        ready, go = folder / "ready", folder / "go"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
               "PAUSE_POINT": point, "PAUSE_READY": str(ready), "PAUSE_GO": str(go)}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        runs.append((point, sig, complete, proc, out, ready, go))
    try:
        waiting = list(runs)
        deadline = time.monotonic() + 300
        while waiting:
            for run in list(waiting):
                point, sig, _, proc, _, ready, go = run
                if ready.exists():
                    proc.send_signal(sig)
                    time.sleep(0.05)  # the handler runs while the run is paused there
                    go.write_text("")
                    waiting.remove(run)
                elif proc.poll() is not None:
                    pytest.fail(f"the run ended before {point}: {proc.communicate()[1][-2000:]}")
            assert time.monotonic() < deadline, f"runs never reached {[r[0] for r in waiting]}"
            time.sleep(0.01)
        for point, sig, complete, proc, out, _, _ in runs:
            _, err = proc.communicate(timeout=120)
            _check(point, sig, complete, proc.returncode, out, err)
    finally:
        for run in runs:
            if run[3].poll() is None:
                run[3].kill()
                run[3].wait()


def _check(point: str, sig: signal.Signals, complete: bool, code: int, out: Path, err: str) -> None:
    where = f"{sig.name} at {point}"
    summary = json.loads(out.with_name("out.summary.json").read_text())
    lines = out.read_text().splitlines()
    assert "Traceback" not in err and "Exception ignored" not in err, (where, err)
    if complete:
        assert code == 0, (where, err)
        assert summary["status"] == "completed" and "signal" not in summary, where
        assert len(lines) == summary["records"]["total"] == ROWS, where
        assert "interrupted" not in err, (where, err)
        assert f"batchgen: {sig.name} arrived once every record was written: the run is complete" in err, (where, err)
    else:
        assert code == 128 + sig, (where, err)
        assert (summary["status"], summary["signal"]) == ("interrupted", sig.name), where
        assert summary["records"]["total"] == len(lines) < ROWS, where
        assert err.splitlines()[-1] == (f"batchgen: error: interrupted by {sig.name}; the summary says 'interrupted'; "
                                        f"rerun with --resume to continue ({out})"), where
    assert not out.with_name("out.jsonl.lock").exists(), where
