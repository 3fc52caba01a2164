"""The run's progress bar: tqdm over generated tokens, with finished records alongside.

The bar's total starts as an upper bound (every record generating ``max_tokens`` for each of its
samples or beams) and shrinks as records finish early, so tokens/s is exact and the ETA
tightens as the run goes. The bar is silent when disabled (``--quiet`` or stderr not a TTY).
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """Progress over generated tokens and finished records.

    Args:
        num_records: records this run will finish (resumed ones excluded).
        tokens_per_record: the most tokens one record can generate (``max_tokens`` times the
            number of samples or beams).
        enabled: draw the bar; None means "when stderr is a TTY".
    """

    def __init__(self, num_records: int, tokens_per_record: int, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.num_records = num_records
        self.tokens_per_record = tokens_per_record
        self.records_done = 0
        self.records_failed = 0
        self._bar: Any = tqdm(
            total=num_records * tokens_per_record,
            unit="tok",
            dynamic_ncols=True,
            disable=not enabled,
            desc="generating",
            file=sys.stderr,
        )
        self._show_records()

    def on_tokens(self, count: int) -> None:
        """Engine callback: ``count`` tokens were generated in the last step."""
        self._bar.update(count)

    def record_finished(self, generated_tokens: int, failed: bool) -> None:
        """A record finished after generating ``generated_tokens``; shrink the estimate."""
        self.records_done += 1
        self.records_failed += int(failed)
        unused = max(self.tokens_per_record - generated_tokens, 0)
        # Never below what has been counted already, so the bar cannot overflow.
        self._bar.total = max(self._bar.total - unused, self._bar.n)
        self._show_records()

    def _show_records(self) -> None:
        postfix = f"records {self.records_done}/{self.num_records}"
        if self.records_failed:
            postfix += f", {self.records_failed} failed"
        self._bar.set_postfix_str(postfix, refresh=True)

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
