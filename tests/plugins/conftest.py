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



@pytest.fixture
def make_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, str], Path]:
    """``make_distribution(name, version, entry_points)``: an installed-looking distribution, a
    ``.dist-info`` folder on the temporary sys.path entry that importlib.metadata finds, whose
    ``entry_points`` are lines of its ``[batchgen]`` group (``plugin = module``)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(name: str, version: str, entry_points: str) -> Path:
        info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[batchgen]\n{entry_points}\n", encoding="utf-8")
        return info

    return make
