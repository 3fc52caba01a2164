"""Config problems: :class:`ConfigIssue` (a key path and a message) and :class:`ConfigError`
(all the issues of one config, raised once; the CLI prints it and exits 2).

This module imports nothing heavy.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence


class ConfigIssue(typing.NamedTuple):
    """One problem in a config: where (dotted key path, "" for the whole file) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A config or usage problem; the CLI prints it and exits with status 2.

    ``issues`` holds every problem found, so the user can fix them all in one go.
    """

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if len(self.issues) == 1:
            return f"{where}invalid config: {self.issues[0]}"
        lines = [f"{where}invalid config ({len(self.issues)} errors):"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


def quoted(choices: Sequence[str]) -> str:
    """``'a', 'b', 'c'``: choices as a message lists them."""
    return ", ".join(f"'{c}'" for c in choices)
