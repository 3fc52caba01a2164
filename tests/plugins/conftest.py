"""Fixtures for the plugin tests: throwaway plugin modules on a temporary sys.path entry."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], str]]:
    """``make_module(name, source)`` writes an importable module and returns its name.

    The modules are removed from ``sys.modules`` afterwards so that tests can reuse names.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)

