"""Fixtures of the GGUF tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny files' metadata folders go to a cache of their own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(folder))
    return folder
