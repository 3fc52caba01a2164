"""The output's lock: one run per output file at a time.

:class:`OutputLock` holds an exclusive ``flock`` on ``<output>.lock`` for the whole run. The
kernel drops the lock when its process dies, even by SIGKILL, so a lock file left behind by a
killed run is free and is simply taken over.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from batchgen.io.output_file import OutputError, OutputInUseError, os_reason

__all__ = ["OutputLock", "lock_path"]

logger = logging.getLogger(__name__)

def lock_path(output: str | Path) -> Path:
    """The lock file of an output: ``results.jsonl`` -> ``results.jsonl.lock``."""
    output = Path(output)
    return output.with_name(output.name + ".lock")


def _holder_text(fd: int) -> str:
    """What a lock file says about its holder, for the error message of a second run."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process"
    text = f"pid {info['pid']}"
    if info.get("host") and info["host"] != socket.gethostname():
        text += f" on {info['host']}"
    if info.get("started_at"):
        text += f" (started {info['started_at']})"
    return text


class OutputLock:
    """An exclusive lock on one output file, held by one run from start to end.

    The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<output>.lock``, which holds the holder's
    pid, host and start time. A second run (in this process or another) gets
    :class:`OutputInUseError` naming the holder. The kernel releases a flock when its process
    dies, so a lock file that a killed run left behind is free: the next run takes it over.
    :meth:`release` removes the lock file. On a file system without ``flock`` support the run
    goes on unlocked, with a warning.
    """

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)
        self.path = lock_path(output)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        """Take the lock or raise :class:`OutputInUseError`; returns self."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_text(fd)
                os.close(fd)
                raise OutputInUseError(
                    f"output file {self.output} is in use by {holder}; wait for that run to end or "
                    f"stop it, or write to another output.path (lock file {self.path})"
                ) from None
            except OSError as exc:  # e.g. ENOLCK on a file system without locks
                os.close(fd)
                logger.warning("cannot lock %s (%s); running without a lock", self.path, os_reason(exc))
                return self
            # The previous holder may have removed the file between our open and our flock:
            # then we hold a lock on a file nobody else will ever see. Start over.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is None or (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            self._fd = fd
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            }
            try:  # best effort: the flock is the lock; the text only helps the message
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode("utf-8") + b"\n", 0)
            except OSError:
                pass
            return self
        raise OutputError(f"could not take the lock {self.path}: it kept being replaced")  # pragma: no cover

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still holding it: see the inode check in acquire()
        except OSError:
            pass
        os.close(fd)

    def holder(self) -> str | None:
        """Who holds the lock now (``pid N (started ...)``), or None when it is free."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_text(fd)
        except OSError:
            return None
        finally:
            os.close(fd)  # closing drops a lock we may just have taken
        return None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
