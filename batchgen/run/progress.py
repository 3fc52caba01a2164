"""The run's progress: a bar on a terminal, a log line every so often elsewhere.

* On a terminal (stderr is a TTY) a tqdm bar counts finished records out of a total that never
  moves, so its rate and ETA are honest; generated tokens and tokens/s ride along as a postfix.
* Off a terminal (CI, ``nohup``, a log file) the bar would be noise, so a plain line is printed
  every ``log_interval`` seconds instead: records done, failed, tokens/s and an ETA. So it is on
  a terminal that reports no width (0 columns, as a fresh pseudo-terminal or some CI runners
  do), where tqdm would draw every bar as a blank line.
* ``--quiet`` silences both.

A scoring job (``scoring=True``) speaks of scoring: ``scoring 4 row(s)``, ``4/4 rows, 812 tokens
scored, 95.0 tok/s``, its tokens being each finished record's scored prompt tokens (nothing is
generated).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Literal, TextIO

from tqdm import tqdm

#: Seconds between two progress lines when stderr is not a terminal.
LOG_INTERVAL = 30.0

Mode = Literal["bar", "log", "off"]
_clock = time.monotonic  # replaced in tests


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _columns(stream: TextIO) -> int | None:
    """The width of the terminal ``stream`` writes to (``COLUMNS`` when it cannot be asked), or
    None when nothing tells."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = os.environ.get("COLUMNS", "")
        return int(columns) if columns.strip().isdigit() else None


class Progress:
    """Progress over finished records, with generated tokens alongside.

    Args:
        num_records: records this run will finish (resumed ones excluded).
        mode: ``"bar"``, ``"log"`` or ``"off"``; None picks ``"bar"`` when ``stream`` is a
            terminal and ``"log"`` otherwise.
        log_interval: seconds between two lines in ``"log"`` mode.
        stream: where to write (default: stderr).
        scoring: a scoring job's words; tokens are counted from :meth:`record_finished`.
    """

    def __init__(
        self,
        num_records: int,
        mode: Mode | None = None,
        log_interval: float = LOG_INTERVAL,
        stream: TextIO | None = None,
        scoring: bool = False,
    ) -> None:
        self.scoring = scoring
        self._noun, self._tokens = ("row", " tokens scored") if scoring else ("record", " tokens")
        self.stream = stream if stream is not None else sys.stderr
        if mode is None:
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() and _columns(self.stream) != 0 else "log"
        self.mode: Mode = mode
        self.num_records = num_records
        self.records_done = 0
        self.records_failed = 0
        self.tokens = 0
        self.log_interval = log_interval
        self._start = _clock()
        self._last_log = self._start
        self._last_draw = self._start
        self._closed = False
        self._bar: Any = tqdm(
            total=num_records,
            unit="row" if scoring else "rec",
            dynamic_ncols=True,
            disable=mode != "bar",
            desc="scoring" if scoring else "generating",
            file=self.stream,
        )
        if mode == "log":
            self._print(f"{'scoring' if scoring else 'generating'} {num_records} {self._noun}(s)")
        self._show()

    # -- engine and pipeline callbacks ---------------------------------------------------------

    def on_tokens(self, count: int) -> None:
        """Engine callback: ``count`` tokens were generated in the last step."""
        self.tokens += count
        self._tick()

    def record_finished(self, generated_tokens: int, failed: bool) -> None:
        """A record was written. A generation job counts tokens as the engine reports them
        (``generated_tokens`` is kept for callers); a scoring job adds ``generated_tokens``, then
        the record's scored tokens."""
        if self.scoring:
            self.tokens += generated_tokens
        self.records_done += 1
        self.records_failed += int(failed)
        self._bar.update(1)
        self._tick()

    # -- rendering -----------------------------------------------------------------------------

    def _rate(self) -> float:
        elapsed = _clock() - self._start
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """``12/40 records (1 failed), 3,456 tokens, 85.3 tok/s, ETA 2m10s`` (a scoring job:
        ``12/40 rows (1 failed), 3,456 tokens scored, ...``)."""
        elapsed = _clock() - self._start
        text = f"{self.records_done}/{self.num_records} {self._noun}s"
        if self.records_failed:
            text += f" ({self.records_failed} failed)"
        text += f", {self.tokens:,}{self._tokens}, {self._rate():.1f} tok/s"
        left = self.num_records - self.records_done
        if self.records_done and left > 0:
            text += f", ETA {_duration(elapsed / self.records_done * left)}"
        elif left > 0:
            text += ", ETA after the first record"
        return text

    def _show(self) -> None:
        if self.mode != "bar":
            return
        postfix = f"{self.tokens:,} tok{' scored' if self.scoring else ''}, {self._rate():.1f} tok/s"
        if self.records_failed:
            postfix += f", {self.records_failed} failed"
        self._bar.set_postfix_str(postfix, refresh=False)

    def _tick(self) -> None:
        now = _clock()
        if self.mode == "bar":
            if now - self._last_draw >= 0.2:  # tokens arrive every step; redraw a few times a second
                self._last_draw = now
                self._show()
                self._bar.refresh()
        elif self.mode == "log":
            if now - self._last_log >= self.log_interval:
                self._last_log = now
                self._print(self.line())

    def _print(self, text: str) -> None:
        print(f"batchgen: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar (idempotent); in log mode, print the final count once."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "log" and self.records_done:
            self._print(self.line())
        self._show()
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def announce(text: str, quiet: bool = False, stream: TextIO | None = None) -> None:
    """Print ``batchgen: <text>`` to stderr unless quiet (e.g. while the model loads)."""
    if not quiet:
        print(f"batchgen: {text}", file=stream if stream is not None else sys.stderr, flush=True)
