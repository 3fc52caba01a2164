"""Failed rows: why they failed, counted by reason, and the ``--max-failed-rows`` rule.

A row that cannot run is an error record at ``batchgen run`` and a note at ``batchgen
validate``; both then apply one rule (:func:`over_limit`): more failed rows than
``--max-failed-rows`` allows is exit status 3. The limit is 0 for a scoring job (a metric over a
subset of the rows is a different metric) and none for a generation job (whose failures
``--max-error-rate`` governs while it runs), unless the flag is given.

A reason is an error message with its row-specific values taken out (quoted text and numbers
become ``…``), so that ``the answer 'Paris' is none of ...`` and ``the answer 'Rome' is none of
...`` count as one.

This module imports nothing of batchgen.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["Reasons", "default_limit", "describe", "over_limit", "reason", "verdict"]

_PARENTHESES = re.compile(r"\([^()]*\)")
_QUOTED = re.compile(r"(?<!\w)'[^']*'(?!\w)|\"[^\"]*\"")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def reason(message: str) -> str:
    """``message`` without its row-specific values: quoted text, parentheses and numbers become
    ``…``."""
    return _NUMBER.sub("…", _QUOTED.sub("…", _PARENTHESES.sub("…", str(message)))).strip()


class Reasons:
    """Failed rows counted by :func:`reason`, each with its first example."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, Any] = {}

    def add(self, message: str, example: Any) -> None:
        key = reason(message)
        self.counts[key] += 1
        self.examples.setdefault(key, example)

    def most_common(self, n: int = 3) -> list[dict[str, Any]]:
        """``[{"reason", "count", "example"}]``, the most common first."""
        return [{"reason": key, "count": count, "example": self.examples[key]}
                for key, count in self.counts.most_common(n)]


def default_limit(scores: bool, given: int | None) -> int | None:
    """The ``--max-failed-rows`` in force: ``given``, else 0 for a scoring job, else None (no limit)."""
    if given is not None:
        return given
    return 0 if scores else None


def over_limit(failed: int, limit: int | None) -> bool:
    """True when ``failed`` rows break the limit (exit status 3)."""
    return limit is not None and failed > limit


def describe(failed: int, total: int, reasons: Iterable[Mapping[str, Any]], example: Any = None) -> str:
    """``2 of 4 rows failed; most often (2 rows): <reason>, e.g. <example>``; ``example`` turns a
    reason's example into text (default ``str``)."""
    text = f"{failed} of {total} row{'' if total == 1 else 's'} failed"
    top = next(iter(reasons), None)
    if top is not None:
        shown = example(top["example"]) if example is not None else str(top["example"])
        text += f"; most often ({top['count']} row{'' if top['count'] == 1 else 's'}): {shown}"
    return text


def verdict(records: Mapping[str, Any], scores: bool, given: int | None,
            example: Callable[[Any], str] | None, files: str) -> tuple[str, bool] | None:
    """What the end of a run says about its failed rows (the summary's ``records``): None when
    none failed, else ``(text, over the limit)``."""
    failed = int(records.get("error") or 0)
    if not failed:
        return None
    limit = default_limit(scores, given)
    text = describe(failed, int(records.get("total") or failed), records.get("error_reasons") or (), example)
    if over_limit(failed, limit):
        why = " (a metric over a subset of the rows is another metric)" if scores and given is None else ""
        return (f"{text}; over --max-failed-rows {limit}{why}: fix the rows, or pass --max-failed-rows "
                f"{failed} to accept them; the error records are in {files}"), True
    return text + (f" (within --max-failed-rows {limit})" if limit is not None else ""), False
