"""Progress: a bar over records with a total that never moves on a terminal, a log line every
so often elsewhere, nothing with --quiet."""

from __future__ import annotations

import io

import pytest

from batchgen.run.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_counts_records_with_a_fixed_total_and_tokens_alongside() -> None:
    stream = _Terminal()
    with Progress(num_records=3, stream=stream) as progress:
        assert progress.mode == "bar"
        progress.on_tokens(40)
        progress.record_finished(generated_tokens=3, failed=False)
        progress.on_tokens(25)
        progress.record_finished(generated_tokens=10, failed=True)
        # The total is the number of records: it does not shrink as records finish early.
        assert (progress._bar.total, progress._bar.n) == (3, 2)
        assert progress.tokens == 65
    text = stream.getvalue()
    assert "2/3" in text and "65 tok" in text and "1 failed" in text and "rec" in text


def test_log_lines_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("batchgen.run.progress._clock", lambda: clock[0])
    stream = io.StringIO()  # not a terminal: the default is a log line every interval
    with Progress(num_records=4, stream=stream, log_interval=30) as progress:
        assert progress.mode == "log"
        clock[0] += 10
        progress.on_tokens(100)
        progress.record_finished(5, failed=False)  # 10 s in: no line yet
        clock[0] += 20
        progress.on_tokens(200)  # 30 s in: one line
        clock[0] += 5
        progress.record_finished(5, failed=True)  # 35 s in: not again before 60 s
    lines = stream.getvalue().splitlines()
    assert lines[0] == "batchgen: generating 4 record(s)"
    # 1 of 4 records after 30 s: 90 s left; 300 tokens in 30 s.
    assert lines[1] == "batchgen: 1/4 records, 300 tokens, 10.0 tok/s, ETA 1m30s"
    assert lines[2] == "batchgen: 2/4 records (1 failed), 300 tokens, 8.6 tok/s, ETA 35s"  # the final line
    assert len(lines) == 3


def test_quiet_prints_nothing() -> None:
    stream = _Terminal()
    with Progress(num_records=3, mode="off", stream=stream) as progress:
        progress.on_tokens(5)
        progress.record_finished(5, failed=False)
    assert stream.getvalue() == ""


def test_a_terminal_of_no_width_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh pseudo-terminal reports 0 columns: tqdm would draw blank lines there, so the
    progress falls back to log lines; given a width, it draws the bar."""
    import fcntl
    import os
    import select
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as stream:
            assert os.get_terminal_size(slave).columns == 0 and stream.isatty()
            with Progress(num_records=2, stream=stream) as progress:
                assert progress.mode == "log"
                progress.record_finished(3, failed=False)
            stream.flush()
            text = ""
            while "1/2 records" not in text and select.select([master], [], [], 5)[0]:
                text += os.read(master, 4096).decode()  # the pty hands the lines over in pieces
            lines = [line for line in text.replace("\r", "").split("\n") if line]
            assert lines[0] == "batchgen: generating 2 record(s)" and lines[-1].startswith("batchgen: 1/2 records")
            assert all(line.strip() for line in text.replace("\r", "").split("\n")[:-1])  # no blank line
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            with Progress(num_records=2, stream=stream) as progress:
                assert progress.mode == "bar"
    finally:
        os.close(master)
        os.close(slave)
    for columns, mode in ((None, "bar"), ("0", "log"), ("100", "bar")):  # a stream that cannot be asked
        if columns is not None:
            monkeypatch.setenv("COLUMNS", columns)
        with Progress(num_records=1, stream=_Terminal()) as progress:
            assert progress.mode == mode
