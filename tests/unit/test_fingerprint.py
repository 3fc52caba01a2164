"""The resume fingerprint: every key of the config schema is classified, and a difference is
any key whose value changed or that one side does not record."""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest
from pydantic import BaseModel

from batchgen.config import RunConfig, resolved_dict, validate_config
from batchgen.run.fingerprint import FINGERPRINT_KEYS, NOT_FINGERPRINTED, config_differences, source_digest


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (through Optional), or None for a leaf value."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        found = [_section(arg) for arg in typing.get_args(annotation)]
        return next((f for f in found if f is not None), None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted as the resolved config spells it."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        inner = _section(field.annotation)
        keys += _leaf_keys(inner, key + ".") if inner is not None else [key]
    return keys


def _covers(entry: str, key: str) -> bool:
    return key == entry or key.startswith(entry + ".")


def test_every_config_key_is_fingerprinted_or_says_why_not() -> None:
    """A new setting that changes tokens or scores must join FINGERPRINT_KEYS; one that does
    not, NOT_FINGERPRINTED with its reason. This fails until it is in exactly one of them."""
    keys = _leaf_keys(RunConfig)
    assert "engine.quantization" in keys and "generation.sampler.options" in keys and "metrics" in keys
    unclassified = [k for k in keys if not any(_covers(e, k) for e in (*FINGERPRINT_KEYS, *NOT_FINGERPRINTED))]
    assert not unclassified, f"classify these config keys in batchgen/run/fingerprint.py: {unclassified}"
    both = [k for k in keys if any(_covers(e, k) for e in FINGERPRINT_KEYS)
            and any(_covers(e, k) for e in NOT_FINGERPRINTED)]
    assert not both, both
    stale = [e for e in (*FINGERPRINT_KEYS, *NOT_FINGERPRINTED) if not any(_covers(e, k) for k in keys)]
    assert not stale, f"not config keys (any more): {stale}"
    assert all(len(reason) > 10 for reason in NOT_FINGERPRINTED.values())


def test_the_settings_that_change_bits_are_fingerprinted() -> None:
    for key in ("engine.quantization", "engine.attention_backend", "engine.linear_backend", "model.dtype",
                "model.device", "model.name", "engine.seed", "prompt", "generation"):
        assert key in FINGERPRINT_KEYS, key


def _resolved(**sections: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"data": {"source": "rows.jsonl"}, "output": {"path": "out.jsonl"}}
    return resolved_dict(validate_config({**base, **sections}))


def test_differences_count_missing_keys_and_normalize_the_device() -> None:
    scoring = {"mode": "loglikelihood", "choices": "options"}
    now = _resolved(model={"device": "cuda"}, generation=scoring)
    assert config_differences(now, now) == []
    assert config_differences(_resolved(model={"device": "cuda:1"}, generation=scoring), now) == []
    assert config_differences(_resolved(model={"device": "cpu"}, generation=scoring), now) == [
        'model.device: "cpu" before, "cuda" now']
    empty = config_differences({}, now)
    assert 'engine.quantization: (not recorded) before, "auto" now' in empty
    assert 'generation.choices: (not recorded) before, "options" now' in empty
    assert len(empty) == len(FINGERPRINT_KEYS) - 2 + len(now["prompt"]) + len(now["generation"])
    dropped = {**now, "engine": {k: v for k, v in now["engine"].items() if k != "quantization"}}
    assert config_differences(now, dropped) == ['engine.quantization: "auto" before, (not recorded) now']
    changed = {**now, "generation": {**now["generation"], "target_delimiter": ""}}
    assert config_differences(now, changed) == ['generation.target_delimiter: " " before, "" now']


def test_source_digest_is_the_content(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    first = source_digest(rows)
    assert first == {"bytes": 16, "sha256": first["sha256"]} and source_digest(rows) == first
    rows.write_text('{"prompt": "b"}\n')  # same size, other content
    assert source_digest(rows)["sha256"] != first["sha256"]
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "a.json").write_text("[]")
    digest = source_digest(folder)
    (folder / "a.json").rename(folder / "b.json")  # a renamed file reads as other rows
    assert source_digest(folder) != digest and source_digest(folder)["bytes"] == 2
    assert source_digest(tmp_path / "nope") is None and source_digest(None) is None


def test_a_big_dataset_is_sampled_within_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the read budget a file counts by its ends, size and mtime: an edit at an end is
    seen, and so is a touch; an edit in the middle that keeps both is not (docs/reliability.md)."""
    from batchgen.run import fingerprint

    monkeypatch.setattr(fingerprint, "_HASH_BUDGET", 100)
    monkeypatch.setattr(fingerprint, "_SAMPLE", 10)
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"a" * 60)  # whole: fits in the budget
    big = folder / "b.txt"
    big.write_bytes(b"b" * 200)  # over what is left: sampled
    os.utime(big, ns=(10**18, 10**18))
    first = source_digest(folder)
    assert first["sampled"] is True and first["bytes"] == 260
    big.write_bytes(b"b" * 100 + b"X" + b"b" * 99)
    os.utime(big, ns=(10**18, 10**18))
    assert source_digest(folder) == first  # the middle, size and mtime kept: not seen
    big.write_bytes(b"X" + b"b" * 199)
    os.utime(big, ns=(10**18, 10**18))
    assert source_digest(folder) != first
    (folder / "a.txt").write_bytes(b"a" * 59 + b"X")  # a whole file: any byte counts
    assert source_digest(folder)["sha256"] != first["sha256"]
