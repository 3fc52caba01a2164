"""The quickstart runs the embedded SmolLM2 model end to end, through the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_runs_the_embedded_model(tmp_path: Path, smollm2_path: str) -> None:
    # smollm2_path makes sure the one-time GGUF conversion is done (and shared with other tests).
    script = shutil.which("batchgen")
    command = [script] if script else [sys.executable, "-m", "batchgen.cli"]
    out = tmp_path / "quickstart.jsonl"
    result = subprocess.run(
        [*command, "run", "configs/quickstart.yaml", "--set", f"output.path={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote 8 record(s) to {out} (8 ok, 0 error" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [f"qs-{i}" for i in range(8)]
    for record in records:
        assert record["error"] is None
        assert record["prompt"].startswith("<|im_start|>system\nYou are a helpful assistant.")
        (gen,) = record["generations"]
        assert gen["text"].strip() and 1 <= gen["num_tokens"] <= 48
    # A real model answers a real question.
    capital = next(r for r in records if r["id"] == "qs-1")
    assert "paris" in capital["generations"][0]["text"].lower()
    summary = json.loads((tmp_path / "quickstart.summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["model"]["name"] == "smollm2-135m-instruct"
    kept = sum(r["usage"]["generated_tokens"] for r in records)
    # The engine also counts each record's final EOS, which the text leaves out.
    assert kept <= summary["throughput"]["generated_tokens"] <= kept + len(records)
