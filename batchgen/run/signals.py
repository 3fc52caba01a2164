"""SIGINT and SIGTERM stop a run cleanly, and never at a point where stopping would lie.

:data:`STOP` is this process's one :class:`StopSignals`. The CLI installs it for a run; the
run layer marks the stretches where stopping is safe (:meth:`StopSignals.interruptible`: loading
the data and the model, generating) and the points where a signal that arrived elsewhere is
acted on (:meth:`StopSignals.check`, e.g. after each record).

Contract:

* The first signal is noted. Inside an interruptible stretch it raises
  :class:`~batchgen.run.errors.Interrupted` at once, unless the handler landed inside a
  finaliser (``__del__``): an exception there would only print a traceback and be dropped, so
  the signal waits for the next :meth:`~StopSignals.check`. Outside those stretches (writing
  the summary, closing the executor, hooks) a signal is only noted: nothing ever raises there;
  once the CLI has its exit status, later signals are ignored.
* Later signals are ignored (one line says that the run is stopping), so a second Ctrl-C cannot
  cut the summary short.
* Without :meth:`install` (a library user), nothing changes: Python's own SIGINT handler
  raises ``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from batchgen.run.errors import Interrupted

__all__ = ["STOP", "StopSignals"]


def _in_finaliser(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class StopSignals:
    """Notes SIGINT / SIGTERM and raises :class:`Interrupted` only where that is safe."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self.installed = False
        self._raised = False
        self._depth = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            # os.write, not print: the handler may run in the middle of another write to stderr.
            os.write(2, b"batchgen: stopping; the summary is being written\n")
            return
        self.received = signum
        if self._depth > 0 and not _in_finaliser(frame):
            self._raise()

    def _raise(self) -> None:
        assert self.received is not None
        self._raised = True
        raise Interrupted(self.received)

    def check(self) -> None:
        """Raise :class:`Interrupted` for a signal that arrived where it could not (once)."""
        if self.received is not None and not self._raised:
            self._raise()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A stretch where a signal raises :class:`Interrupted` (a pending one raises on entry)."""
        if not self.installed:
            yield
            return
        self._depth += 1
        try:
            self.check()
            yield
        finally:
            self._depth -= 1

    def install(self) -> StopSignals:
        """Handle SIGINT and SIGTERM in this (main) thread; see the module's contract."""
        if threading.current_thread() is not threading.main_thread():
            return self
        self.received, self._raised, self._depth = None, False, 0
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.installed = True
        return self

    def uninstall(self, *, ignore: bool) -> None:
        """Put back the earlier handlers, or with ``ignore`` ignore both signals from now on (the
        command line, until the process exits: its exit status is settled, and Python's default
        action at shutdown would turn a late Ctrl-C into a traceback or a late SIGTERM into 143)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else previous)
        self._previous.clear()
        self._depth, self.installed = 0, False


#: This process's signal state (see the module's contract).
STOP = StopSignals()
