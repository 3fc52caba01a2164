"""The JSONL output file, resume, and the run summary.

Invariants:

* One JSON object per line, each line written with a single ``write`` of the whole encoded line
  (newline included), then flushed and ``fsync``-ed. A process killed at any instant therefore
  leaves complete lines followed by at most one torn tail without a newline.
* Resuming truncates the file to its last newline (dropping that torn tail) before anything is
  appended, so every line stays valid JSON and lines written before the kill stay byte-identical.
* Non-finite floats (``-inf`` logprobs) are written as ``null``: the file is strict JSON.
* The summary is written to a temp file in the same folder and moved into place with
  ``os.replace``, so a reader sees the old summary or the new one, never half of one.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "OutputError",
    "OutputExistsError",
    "check_writable",
    "prepare_output",
    "read_records",
    "JsonlWriter",
    "encode_record",
    "write_json_atomic",
]


class OutputError(Exception):
    """The output cannot be used as configured (a usage error: the CLI exits with status 2)."""


class OutputExistsError(OutputError):
    """The output file exists and neither resume nor overwrite was asked for."""


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


def prepare_output(path: str | Path, if_exists: Literal["error", "resume", "overwrite"]) -> set[str]:
    """Make ``path`` ready for appending and return the ids already written there.

    * missing or empty file: create it (and its folders); no ids.
    * ``"error"``: an existing non-empty file raises :class:`OutputExistsError` naming both flags.
    * ``"overwrite"``: truncate it; no ids.
    * ``"resume"``: drop a torn last line, then return every id in the file.
    """
    path = Path(path)
    check_writable(path)
    if path.exists() and path.stat().st_size > 0:
        if if_exists == "error":
            raise OutputExistsError(
                f"output file {path} already exists; pass --resume to skip the records already in it "
                "or --overwrite to start over (or set output.if_exists to 'resume' or 'overwrite')"
            )
        if if_exists == "resume":
            _repair_tail(path)
            return {str(record["id"]) for record in read_records(path)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb"):
            pass
    except OSError as exc:
        raise OutputError(f"output path {path} is not writable: {exc.strerror or exc}") from None
    return set()


class JsonlWriter:
    """Appends records to a JSONL file, one durable line per record.

    Use as a context manager. :meth:`write` returns only after the line is fsync-ed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Unbuffered: every write() is one os.write of the whole line (see the module invariants).
        self._file = open(self.path, "ab", buffering=0)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and make it durable."""
        data = memoryview(encode_record(record))
        while data:
            written = self._file.write(data)
            data = data[written or 0 :]
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (temp file + fsync + os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; give the summary the permissions of any new file (umask applied).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_finite(data), f, indent=2, ensure_ascii=False, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
