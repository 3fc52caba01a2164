"""Every shipped config passes ``batchgen validate`` (schema, plugins, data, template, output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.cli import main
from batchgen.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_expected_examples_ship(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # paths in the shipped configs are relative to the repository root
    assert {p.name for p in CONFIGS} >= {
        "quickstart.yaml",
        "beam_search.yaml",
        "qa_exact_match.yaml",
        "humaneval_pass_at_k.yaml",
        "synthetic_products.yaml",
    }
    modes = {p.name: load_config(p).generation for p in CONFIGS}
    assert modes["beam_search.yaml"].mode == "beam"
    assert modes["humaneval_pass_at_k.yaml"].mode == "sample" and modes["humaneval_pass_at_k.yaml"].n > 1
    assert modes["quickstart.yaml"].max_tokens <= 48
    synthetic = load_config(REPO / "configs" / "synthetic_products.yaml")
    assert synthetic.generation.structured_outputs.json_["required"]  # the schema file, read
    assert {m.name for m in synthetic.metrics} >= {"json_valid", "json_schema_valid"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(
    config: Path, smollm2_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)  # data paths in the shipped configs are relative to the repository root
    code = main(["validate", str(config.relative_to(REPO)), "--set", f"output.path={tmp_path / 'out.jsonl'}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert ": ok (" in captured.out and "note: could not load the tokenizer" not in captured.out
