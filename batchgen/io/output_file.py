"""The JSONL output file (written, repaired for resume, read back) and the run summary file.

Invariants:

* One JSON object per line, each line written with a single ``write`` of the whole encoded line
  (newline included), then ``fsync``-ed: at once, or with ``group_commit`` by a background
  flusher whose one fsync covers every line written meanwhile (a few milliseconds later;
  ``close`` waits for it). A process killed at any instant therefore leaves complete lines
  followed by at most one torn tail without a newline.
* Resuming truncates the file to its last newline (dropping that torn tail) before anything is
  appended, so every line stays valid JSON and lines written before the kill stay byte-identical.
* Non-finite floats (``-inf`` logprobs) are written as ``null``: the file is strict JSON.
* The summary is written to a temp file in the same folder and moved into place with
  ``os.replace``, so a reader sees the old summary or the new one, never half of one.
* A write that fails (a full disk, a quota, an I/O error) raises :class:`OutputWriteError`
  naming the path and the cause; a record line that was cut by the failure is truncated away
  first, so the file still ends with a complete line. A background fsync that fails raises the
  same error at the next write or at ``close``, after truncating the lines it did not cover.
* One run at a time per output: see :mod:`batchgen.io.lock`.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal


__all__ = [
    "OutputError",
    "OutputExistsError",
    "OutputInUseError",
    "OutputWriteError",
    "check_output",
    "check_writable",
    "prepare_output",
    "read_summary",
    "read_records",
    "JsonlWriter",
    "encode_record",
    "write_json_atomic",
]


class OutputError(Exception):
    """The output cannot be used as configured (a usage error: the CLI exits with status 2)."""


class OutputExistsError(OutputError):
    """The output file exists and neither resume nor overwrite was asked for."""


class OutputInUseError(OutputError):
    """Another run holds the output's lock."""


class OutputWriteError(Exception):
    """A record or the summary could not be written (a runtime failure, not a usage error).

    The message names the path and the cause, e.g. ``cannot write to out.jsonl: no space left
    on device``. ``errno`` is the underlying error number.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


def os_reason(exc: OSError) -> str:
    """``no space left on device`` and the like: the OS message, lower-cased at the start."""
    reason = exc.strerror or (errno.errorcode.get(exc.errno or 0) if exc.errno else None) or str(exc)
    return reason[:1].lower() + reason[1:]


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is not an error)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _finite(value: Any) -> Any:
    """Copy of ``value`` with non-finite floats replaced by None (strict JSON has no inf/nan)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode_record(record: dict[str, Any]) -> bytes:
    """One record as a UTF-8 JSON line ending in ``\\n`` (no other newline inside)."""
    # ensure_ascii=False keeps non-English text readable; json escapes any newline in strings.
    return (json.dumps(_finite(record), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def check_writable(path: str | Path) -> None:
    """Raise :class:`OutputError` unless ``path`` can be created or appended to.

    Creates nothing: it checks the nearest existing ancestor folder instead (the run creates the
    missing folders in between).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"output path {path} is a folder; give a file path such as {path / 'results.jsonl'}")
    if path.exists() and not path.is_file():
        raise OutputError(f"output path {path} is not a regular file ({_file_kind(path)}); records and summaries "
                          "go to regular files: give a file path such as results.jsonl")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OutputError(f"output file {path} is not writable (permission denied)")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"output path {path} is not writable: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"output path {path} is not writable: cannot create files in {ancestor} (permission denied)")


def _file_kind(path: Path) -> str:
    """``a character device`` and the like, for a path that is neither a file nor a folder."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def check_output(path: str | Path, if_exists: Literal["error", "resume", "overwrite"]) -> None:
    """Raise :class:`OutputExistsError` when ``path`` is a non-empty file and ``if_exists`` is
    ``"error"`` (naming both flags); check it is writable. Changes nothing."""
    path = Path(path)
    check_writable(path)
    if if_exists == "error" and path.exists() and path.stat().st_size > 0:
        raise OutputExistsError(
            f"output file {path} already exists; pass --resume to skip the records already in it "
            "or --overwrite to start over (or set output.if_exists to 'resume' or 'overwrite')"
        )


def _repair_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline; return the number of bytes dropped."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        # Scan backwards in chunks for the last newline; the torn tail is at most one line.
        pos, keep = size, 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = pos + idx + 1
                break
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSONL output, skipping a torn last line (no trailing newline).

    Raises :class:`OutputError` for a complete line that is not a JSON object with an ``id``:
    such a file was not written by batchgen, and appending to it would hide the damage.
    """
    path = Path(path)
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                return  # torn tail of a killed run
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise OutputError(f"{path}, line {number}: not valid JSON ({exc}); cannot resume this file") from None
            if not isinstance(record, dict) or "id" not in record:
                raise OutputError(f"{path}, line {number}: not a batchgen record (no 'id'); cannot resume this file")
            yield record


def prepare_output(
    path: str | Path, if_exists: Literal["error", "resume", "overwrite"], key: str | None = "id"
) -> set[str]:
    """Make ``path`` ready for appending and return the ids already written there.

    * missing or empty file: create it (and its folders); no ids.
    * ``"error"``: an existing non-empty file raises :class:`OutputExistsError` naming both flags.
    * ``"overwrite"``: truncate it; no ids.
    * ``"resume"``: drop a torn last line, then return the ``key`` field of every record in the
      file (null keys left out); with ``key=None`` return nothing, for a caller that reads the
      file itself.
    """
    path = Path(path)
    check_output(path, if_exists)
    if path.exists() and path.stat().st_size > 0:
        if if_exists == "resume":
            _repair_tail(path)
            if key is None:
                return set()
            return {str(record[key]) for record in read_records(path) if record.get(key) is not None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb"):
            pass
    except OSError as exc:
        raise OutputError(f"output path {path} is not writable: {exc.strerror or exc}") from None
    return set()


def read_summary(path: str | Path) -> dict[str, Any] | None:
    """The run summary at ``path``, or None when there is none (or it is not a JSON object)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class _Flusher:
    """Group commit: a thread that fsyncs a file whenever lines were written since its last fsync.

    It syncs through its own duplicate of the writer's descriptor, so that the writer may close
    its own at any moment (a signal landing in ``close``) without the thread syncing a closed or
    reused descriptor. ``synced`` is the file size the last successful fsync covers; an fsync
    error is kept in ``error`` and ends the thread.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd = os.dup(fd)
        self._cond = threading.Condition()
        self._written = self.synced = size
        self._closing = False
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="batchgen-fsync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._written == self.synced and not self._closing:
                        self._cond.wait()
                    target = self._written
                    if target == self.synced:  # closing, nothing left
                        return
                try:
                    os.fsync(self._fd)  # releases the GIL; lines written meanwhile ride on the next one
                except OSError as exc:
                    with self._cond:
                        self.error = exc
                        self._cond.notify_all()
                    return
                with self._cond:
                    self.synced = target
                    self._cond.notify_all()
        finally:
            os.close(self._fd)

    def written(self, size: int) -> None:
        """The file holds ``size`` bytes of complete lines now: have them fsynced soon."""
        with self._cond:
            self._written = size
            self._cond.notify_all()

    def close(self) -> None:
        """Return once every line written is fsynced, or the fsync failed (see ``error``)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()


class JsonlWriter:
    """Appends records to a JSONL file, one durable line per record.

    Use as a context manager. :meth:`write` returns only after the line is fsync-ed, or, with
    ``group_commit=True``, as soon as it is written, with a background fsync that covers all the
    lines written meanwhile (for jobs that finish many records at once); :meth:`close` returns
    once every line is fsynced.

    When a line cannot be written whole, :meth:`write` truncates the file back to where the line
    began and raises :class:`OutputWriteError`. When a background fsync fails, the next
    :meth:`write` or :meth:`close` truncates the file back to what the last good fsync covered
    (the lines after it may not be on disk) and raises the same error.
    """

    def __init__(self, path: str | Path, *, group_commit: bool = False) -> None:
        self.path = Path(path)
        # One os.write of the whole line per record (see the module invariants).
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._size = os.fstat(self._fd).st_size
        self._flusher = _Flusher(self._fd, self._size) if group_commit else None

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and make it durable (see the class docstring)."""
        assert self._fd is not None, "the writer is closed"
        self._check_flusher()
        data = encode_record(record)
        try:
            _write_all(self._fd, data)
            if self._flusher is None:
                os.fsync(self._fd)
        except OSError as exc:
            self._truncate(self._size)  # drop the part of the line that made it
            raise self._write_error(exc) from exc
        self._size += len(data)
        if self._flusher is not None:
            self._flusher.written(self._size)

    def _write_error(self, exc: OSError) -> OutputWriteError:
        return OutputWriteError(f"cannot write to {self.path}: {os_reason(exc)}", exc.errno)

    def _truncate(self, size: int) -> None:
        """Cut the file back to ``size`` bytes, so that it stays valid JSONL."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass  # resume drops a torn last line anyway
        self._size = min(self._size, size)

    def _check_flusher(self) -> None:
        """Raise the group commit's fsync error, after dropping the lines it may have lost."""
        flusher = self._flusher
        if flusher is not None and flusher.error is not None:
            self._truncate(flusher.synced)
            raise self._write_error(flusher.error) from flusher.error

    def close(self) -> None:
        """Wait for the last fsync and close the file (idempotent); raises as :meth:`write` does
        when a background fsync failed."""
        if self._fd is None:
            return
        try:
            if self._flusher is not None:
                self._flusher.close()
                self._check_flusher()
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except OutputWriteError:
            pass  # the exception on its way out is the one to report; the file is valid either way


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (temp file + fsync + os.replace).

    Raises:
        OutputWriteError: the file could not be written (the old one, if any, is untouched).
    """
    path = Path(path)
    text = json.dumps(_finite(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            # mkstemp creates 0600; give the summary the permissions of any new file (umask applied).
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
            _write_all(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise OutputWriteError(f"cannot write {path}: {os_reason(exc)}", exc.errno) from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
