"""docs/reliability.md names the tests that hold each guarantee: they must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_named_in_the_reliability_doc_exists() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    files = set(re.findall(r"`(tests/[\w/]+\.py)", text))
    names = set(re.findall(r"(?:::|`)(test_\w+)`", text))
    assert len(files) >= 8 and len(names) >= 20
    for path in files:
        assert (ROOT / path).is_file(), path
    defined = {m for p in ROOT.glob("tests/**/test_*.py") for m in re.findall(r"^def (test_\w+)", p.read_text(), re.M)}
    assert not names - defined, sorted(names - defined)
