"""The JSONL writer, resume repair and the atomic summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from batchgen.output import (
    JsonlWriter,
    OutputError,
    OutputExistsError,
    check_writable,
    encode_record,
    prepare_output,
    read_records,
    write_json_atomic,
)


def _write(path: Path, records: list[dict]) -> None:
    with JsonlWriter(path) as writer:
        for record in records:
            writer.write(record)


def test_lines_are_strict_json_one_per_record(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    assert prepare_output(path, "error") == set()
    records = [
        {"id": "a", "text": "line one\nline two", "lp": -math.inf},
        {"id": "b", "text": "héllo ✓", "lp": float("nan")},
    ]
    _write(path, records)
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3  # exactly one newline per record
    first = json.loads(lines[0])
    assert first["text"] == "line one\nline two" and first["lp"] is None
    assert "héllo ✓" in lines[1].decode("utf-8")  # not \u-escaped
    assert [r["id"] for r in read_records(path)] == ["a", "b"]


def test_existing_output_without_flag_names_both_flags(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, [{"id": "a"}])
    with pytest.raises(OutputExistsError) as info:
        prepare_output(path, "error")
    assert "--resume" in str(info.value) and "--overwrite" in str(info.value)
    assert str(path) in str(info.value)


def test_empty_existing_file_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"")
    assert prepare_output(path, "error") == set()


def test_overwrite_truncates(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, [{"id": "a"}, {"id": "b"}])
    assert prepare_output(path, "overwrite") == set()
    assert path.read_bytes() == b""


def test_resume_drops_torn_tail_and_keeps_complete_lines_byte_identical(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, [{"id": "a", "x": 1}, {"id": 7, "x": 2}])
    intact = path.read_bytes()
    with open(path, "ab") as f:
        f.write(encode_record({"id": "c", "x": 3})[:9])  # a line cut mid-write
    assert prepare_output(path, "resume") == {"a", "7"}
    assert path.read_bytes() == intact
    _write(path, [{"id": "c", "x": 3}])
    assert path.read_bytes().startswith(intact)
    assert [r["id"] for r in read_records(path)] == ["a", 7, "c"]


def test_resume_of_a_file_with_only_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "te')
    assert prepare_output(path, "resume") == set()
    assert path.read_bytes() == b""


def test_resume_refuses_a_corrupt_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(OutputError, match=r"line 2: not valid JSON"):
        prepare_output(path, "resume")
    path.write_bytes(b'{"id": "a"}\n[1, 2]\n')
    with pytest.raises(OutputError, match=r"line 2: not a batchgen record"):
        prepare_output(path, "resume")


def test_unwritable_output_paths(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=r"is not writable: .*afile is a file, not a folder"):
        check_writable(blocker / "sub" / "out.jsonl")
    with pytest.raises(OutputError, match="is a folder"):
        check_writable(tmp_path)
    # Missing intermediate folders are fine: the run creates them.
    check_writable(tmp_path / "new" / "deeper" / "out.jsonl")
    assert prepare_output(tmp_path / "new" / "deeper" / "out.jsonl", "error") == set()
    assert (tmp_path / "new" / "deeper" / "out.jsonl").is_file()


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
def test_permission_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OutputError, match="permission denied"):
        check_writable(locked / "out.jsonl")


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "run.summary.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "inf": math.inf})
    assert json.loads(path.read_text()) == {"a": 2, "inf": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.summary.json"]
    plain = tmp_path / "plain"
    plain.write_text("")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
