"""The fingerprint of a run: the part of the resolved config that decides what a record holds.

``--resume`` appends to the records of an earlier run. That is only sound when both runs would
write the same record for the same row, so a resume compares the fingerprint of its config with
the one kept beside the records (:func:`sidecar_path`, written before the first record) and
refuses on a difference, or when there is none (``--force-resume`` overrides either).

In the fingerprint: the model, its dtype and the other names an OpenAI batch line may give it;
which dataset and how rows are identified (source, subset, split, id column); the whole
``prompt`` and ``generation`` sections (sampler plugin options included, defaults filled); the
engine seed; the output format (batchgen records or OpenAI lines). Not in it: what only selects
rows or changes speed (``data.limit``, ``data.shuffle``, block size, KV budget, backends, batch
sizes), the output paths, and metrics (they score records, and the summary aggregates each
metric over the records that carry it).

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FINGERPRINT_KEYS", "config_differences", "fingerprint", "fingerprint_hash", "read_sidecar", "sidecar",
           "sidecar_path"]

#: Dotted keys of the resolved config (a whole section, or one key of one) in the fingerprint.
FINGERPRINT_KEYS: tuple[str, ...] = (
    "model.name",
    "model.dtype",
    "model.aliases",
    "data.source",
    "data.name",
    "data.split",
    "data.id_column",
    "prompt",
    "generation",
    "engine.seed",
    "output.format",
)


def fingerprint(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprinted values of a resolved config, one level deep: ``{"generation.n": 4,
    "generation.sampler": {"name": ..., "options": {...}}, "model.name": ..., ...}``.

    Keys missing from ``config`` (a summary written by an older version) are left out.
    """
    flat: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        node: Any = config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            if isinstance(node, Mapping) and key.count(".") == 0:  # a whole section
                flat.update({f"{key}.{name}": value for name, value in node.items()})
            else:
                flat[key] = node
    return flat


def fingerprint_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of :func:`fingerprint` (written in the run summary)."""
    blob = json.dumps(fingerprint(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def config_differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: <before> before, <now> now`` for every fingerprinted key whose value changed.

    Only keys present in both are compared, so a summary from a version that lacked a key does
    not count as a change.
    """
    old, new = fingerprint(before), fingerprint(now)
    return [
        f"{key}: {json.dumps(old[key])} before, {json.dumps(new[key])} now"
        for key in sorted(old.keys() & new.keys())
        if old[key] != new[key]
    ]


def sidecar_path(output: str | Path) -> Path:
    """Where the config of an output's records is kept: ``results.jsonl`` ->
    ``results.jsonl.resume.json`` (beside the records, whatever ``output.summary_path`` says)."""
    output = Path(output)
    return output.with_name(output.name + ".resume.json")


def read_sidecar(output: str | Path) -> dict[str, Any] | None:
    """The resolved config the records of ``output`` were written with, or None (no sidecar,
    or one that is not a JSON object with a ``config`` object)."""
    try:
        data = json.loads(sidecar_path(output).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = data.get("config") if isinstance(data, dict) else None
    return config if isinstance(config, dict) else None


def sidecar(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The sidecar's content for a run of ``resolved`` (written by the plan, atomically)."""
    return {"fingerprint": fingerprint_hash(resolved), "config": dict(resolved)}
