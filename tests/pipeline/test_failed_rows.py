"""``--max-failed-rows`` and the final line about failed rows, for generation jobs (scoring jobs:
tests/pipeline/test_scoring_jobs.py): a generation job keeps its old exit rules unless the flag
is given; the reasons are counted with their row values taken out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from batchgen.run.failures import Reasons, reason, verdict

ROWS = [{"qid": f"g{i}", "question": f"What is {i} plus {i}?"} for i in range(4)] + [
    {"qid": "null0", "question": None}, {"qid": "null1", "question": None}]


@pytest.fixture
def generation_job(tmp_path: Path, job_config) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return job_config(data={"source": str(data), "id_column": "qid"}, metrics=[{"name": "length"}],
                      prompt={"column": "question", "template": None, "chat_template": False},
                      generation={"mode": "greedy", "max_tokens": 2})


def test_a_generation_job_with_failed_rows_still_exits_0_and_says_why(generation_job, capsys) -> None:
    from batchgen.cli import main

    assert main(["run", str(generation_job)]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^length: .* \(4 rows, 2 failed\)$", captured.out, re.M)  # what the metric covers
    final = captured.err.strip().splitlines()[-1]
    assert final == ("batchgen: 2 of 6 rows failed; most often (2 rows): id 'null0': column 'question' is empty "
                     "(null) in this row")
    # The flag given: the same rule as a scoring job's.
    assert main(["run", str(generation_job), "--overwrite", "--max-failed-rows", "1"]) == 3
    assert "over --max-failed-rows 1: " in capsys.readouterr().err
    assert main(["run", str(generation_job), "--overwrite", "--max-failed-rows", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_max_failed_rows_must_be_a_count(generation_job, capsys) -> None:
    from batchgen.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", str(generation_job), "--max-failed-rows", "-1"])
    assert info.value.code == 2 and "expected a whole number of rows" in capsys.readouterr().err


def test_reasons_group_messages_that_differ_only_in_their_values() -> None:
    assert reason("the answer 'Paris' is none of the row's choices ('A', 'B')") == \
        reason("the answer 'Rome' is none of the row's choices ('A', 'B', 'C')")
    assert reason("the answer index 5 is out of range") != reason("column 'x' is empty (null) in this row")
    reasons = Reasons()
    for i, message in enumerate(["the answer index 5 is out of range", "prompt too long: 300 tokens",
                                 "the answer index 9 is out of range"]):
        reasons.add(message, {"id": f"r{i}", "error": message})
    top = reasons.most_common()
    assert [(r["count"], r["example"]["id"]) for r in top] == [(2, "r0"), (1, "r1")]
    records = {"total": 10, "ok": 7, "error": 3, "error_reasons": top}
    text, over = verdict(records, True, None, lambda d: f"id {d['id']!r}: {d['error']}", "out.jsonl")
    assert over and text.startswith("3 of 10 rows failed; most often (2 rows): id 'r0': the answer index 5")
    assert verdict(records, False, None, None, "out.jsonl") == (
        "3 of 10 rows failed; most often (2 rows): {'id': 'r0', 'error': 'the answer index 5 is out of range'}", False)
    assert verdict({"total": 3, "ok": 3, "error": 0}, True, None, None, "out.jsonl") is None
