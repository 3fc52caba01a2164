"""A run killed with SIGKILL mid-job, then resumed: every id once, earlier lines untouched."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROWS = 32


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_then_resume(tmp_path: Path, tiny_llama: str, sigkill_after_records) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i:03d}", "prompt": f"Tell me about item {i}."}) + "\n" for i in range(ROWS)))
    out = tmp_path / "out.jsonl"
    config = {
        "model": {"name": tiny_llama, "device": "cpu", "dtype": "float32"},
        "data": {"source": str(data), "id_column": "uid"},
        "prompt": {"column": "prompt", "chat_template": False},
        # Two sequences at a time and a fixed length: records land two by two, one wave
        # every 16 steps, so the job is still far from done when the first lines appear.
        "generation": {"mode": "greedy", "max_tokens": 16, "ignore_eos": True},
        "engine": {"kv_cache_memory": "8MiB", "max_num_seqs": 2},
        "metrics": [{"name": "length"}],
        "output": {"path": str(out)},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"]

    killed = sigkill_after_records(command, out)
    complete = killed[: killed.rfind(b"\n") + 1]
    written_before = [json.loads(line)["id"] for line in complete.splitlines()]
    assert 3 <= len(written_before) < ROWS

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
    assert sorted(ids) == [f"p{i:03d}" for i in range(ROWS)]  # every id exactly once
    assert all(r["error"] is None and r["generations"][0]["num_tokens"] == 16 for r in records)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["records"]["resumed"] == len(written_before)
    assert summary["records"]["this_run"] == ROWS - len(written_before)
    assert summary["records"]["total"] == ROWS
