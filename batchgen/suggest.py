"""The one "did you mean" of batchgen's messages (config keys, plugin names and options, batch lines).

This module imports nothing heavy.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

#: How alike a word and a suggestion must be (difflib's ratio).
CUTOFF = 0.6


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word``, or None when none is alike enough."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=CUTOFF)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice most like ``word``, or ``""``."""
    match = closest(word, choices)
    return f" (did you mean '{match}'?)" if match else ""


def path_suggestion(path: Path) -> str:
    """``" (did you mean '/models/llama'?)"`` for the entry beside a missing ``path`` most like
    it (hidden entries left out), or ``""``."""
    try:
        names = [entry.name for entry in path.parent.iterdir() if not entry.name.startswith(".")]
    except OSError:
        return ""
    match = closest(path.name, names)
    return f" (did you mean '{path.parent / match}'?)" if match else ""
