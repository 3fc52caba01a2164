"""The JSONL writer, resume repair, the atomic summary, the output lock and a full disk."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.io.lock import OutputLock, lock_path
from batchgen.io.output_file import (
    JsonlWriter,
    OutputError,
    OutputExistsError,
    OutputInUseError,
    OutputWriteError,
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


def test_group_commit_fsyncs_lines_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With group commit every line is written at once and fsynced by the flusher, in fewer
    fsyncs than lines; close() returns after the last one."""
    import threading

    path = tmp_path / "out.jsonl"
    calls: list[int] = []
    release = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        release.wait(5)  # the first fsync blocks until every line is written
        calls.append(path.read_bytes().count(b"\n"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    with JsonlWriter(path, group_commit=True) as writer:
        for i in range(50):
            writer.write({"id": str(i)})
            assert path.read_bytes().count(b"\n") == i + 1  # written at once, whatever the fsync
        release.set()
    assert 1 <= len(calls) <= 2 and calls[-1] == 50  # one or two fsyncs covered all 50 lines
    assert [r["id"] for r in read_records(path)] == [str(i) for i in range(50)]


def test_group_commit_fsync_error_is_the_full_disk_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that fails in the flusher (ENOSPC, as delayed allocation reports it) surfaces as
    the writer's one OutputWriteError, and the lines it did not cover are cut away."""
    import threading

    synced_once = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if synced_once.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)
        synced_once.set()

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "out.jsonl"
    writer = JsonlWriter(path, group_commit=True)
    writer.write({"id": "a"})
    assert synced_once.wait(5)
    writer.write({"id": "b"})  # its fsync fails
    with pytest.raises(OutputWriteError) as info:
        writer.close()
    assert str(info.value) == f"cannot write to {path}: no space left on device"
    assert info.value.errno == errno.ENOSPC
    assert [r["id"] for r in read_records(path)] == ["a"]  # what the good fsync covered
    writer.close()  # idempotent

    # With an exception already on its way (Ctrl-C), that one is reported, not the fsync's.
    synced_once.clear()
    with pytest.raises(KeyboardInterrupt), JsonlWriter(path, group_commit=True) as writer:
        writer.write({"id": "c"})
        assert synced_once.wait(5)
        writer.write({"id": "d"})
        raise KeyboardInterrupt
    assert [r["id"] for r in read_records(path)] == ["a", "c"]


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


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    existing = tmp_path / "read-only.jsonl"
    existing.write_text("")
    existing.chmod(0o400)
    if os.geteuid() == 0:
        # Root ignores permission bits; make the folder and the file read-only for everyone.
        real_access = os.access
        denied = {str(locked), str(existing)}
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) in denied else real_access(p, mode))
    with pytest.raises(OutputError, match=r"cannot create files in .*locked \(permission denied\)"):
        check_writable(locked / "out.jsonl")
    with pytest.raises(OutputError, match=r"read-only.jsonl is not writable \(permission denied\)"):
        check_writable(existing)


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "run.summary.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "inf": math.inf})
    assert json.loads(path.read_text()) == {"a": 2, "inf": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.summary.json"]
    plain = tmp_path / "plain"
    plain.write_text("")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


# --------------------------------------------------------------------------- a full disk


def test_full_disk_leaves_complete_lines_and_names_the_path(tmp_path: Path, full_disk) -> None:
    path = tmp_path / "out.jsonl"
    record = {"id": "r", "text": "x" * 100}
    line = len(encode_record(record))
    full_disk(tmp_path).left = 2 * line + line // 2  # the third line is cut
    with JsonlWriter(path) as writer:
        writer.write(record | {"id": "a"})
        writer.write(record | {"id": "b"})
        with pytest.raises(OutputWriteError) as info:
            writer.write(record | {"id": "c"})
    assert str(info.value) == f"cannot write to {path}: no space left on device"
    assert info.value.errno == errno.ENOSPC
    # The cut line was truncated away: the file is valid JSONL as it stands.
    assert path.read_bytes().endswith(b"\n") and len(path.read_bytes()) == 2 * line
    assert [r["id"] for r in read_records(path)] == ["a", "b"]


def test_full_disk_keeps_the_old_summary(tmp_path: Path, full_disk) -> None:
    path = tmp_path / "run.summary.json"
    write_json_atomic(path, {"status": "running"})
    full_disk(tmp_path).left = 10
    with pytest.raises(OutputWriteError, match=rf"cannot write {path}: no space left on device"):
        write_json_atomic(path, {"status": "completed", "pad": "x" * 1000})
    assert json.loads(path.read_text()) == {"status": "running"}  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.summary.json"]  # no temp left


def test_full_tmpfs(tmp_path: Path) -> None:
    """The same on a real full file system, where the platform lets us mount a small tmpfs."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN); the injected ENOSPC tests cover this path")
    try:
        path = mount / "out.jsonl"
        with JsonlWriter(path) as writer, pytest.raises(OutputWriteError, match="no space left on device"):
            for i in range(1000):
                writer.write({"id": str(i), "text": "y" * 500})
        ids = [r["id"] for r in read_records(path)]
        assert path.read_bytes().endswith(b"\n") and 0 < len(ids) < 1000
        assert ids == [str(i) for i in range(len(ids))]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# --------------------------------------------------------------------------- the lock


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    with OutputLock(out) as first:
        assert lock_path(out).is_file() and first.held
        # A flock belongs to an open file: a second open in this process conflicts as well.
        with pytest.raises(OutputInUseError) as info:
            OutputLock(out).acquire()
        message = str(info.value)
        assert message.startswith(f"output file {out} is in use by pid {os.getpid()} (started ")
        assert str(lock_path(out)) in message
        assert OutputLock(out).holder().startswith(f"pid {os.getpid()}")
    assert not lock_path(out).exists() and OutputLock(out).holder() is None
    with OutputLock(out):  # free again
        pass


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    code = (
        "import sys, time\n"
        "from batchgen.io.lock import OutputLock\n"
        "lock = OutputLock(sys.argv[1]).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        with pytest.raises(OutputInUseError, match=rf"in use by pid {child.pid} "):
            OutputLock(out).acquire()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == child.pid  # left behind...
    with OutputLock(out) as lock:  # ...and free: the kernel dropped the dead process's flock
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid() and lock.held
