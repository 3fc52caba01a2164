"""The progress bar: tokens with a shrinking estimate, finished records, quiet off a TTY."""

from __future__ import annotations

import pytest

from batchgen.progress import Progress


def test_bar_counts_tokens_and_records(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(num_records=2, tokens_per_record=10, enabled=True) as progress:
        progress.on_tokens(3)
        progress.record_finished(generated_tokens=3, failed=False)
        # The finished record used 3 of its 10 tokens: the estimate drops by 7.
        assert progress._bar.total == 13
        progress.on_tokens(10)
        progress.record_finished(generated_tokens=10, failed=True)
        assert progress._bar.total == 13 and progress._bar.n == 13
    err = capsys.readouterr().err
    assert "records 2/2, 1 failed" in err and "tok" in err


def test_estimate_never_drops_below_the_count() -> None:
    progress = Progress(num_records=1, tokens_per_record=4, enabled=True)
    progress.on_tokens(6)  # beams may count more tokens than the record keeps
    progress.record_finished(generated_tokens=2, failed=False)
    assert progress._bar.total == 6
    progress.close()


def test_quiet_when_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    # Under pytest's capture stderr is not a terminal, so the default is silence.
    with Progress(num_records=3, tokens_per_record=5) as progress:
        progress.on_tokens(5)
        progress.record_finished(5, failed=False)
    assert capsys.readouterr().err == ""
