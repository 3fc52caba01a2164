"""The fingerprint of a run: the part of the resolved config that decides what a record holds.

``--resume`` appends to the records of an earlier run. That is only sound when both runs would
write the same record for the same row, so a resume compares the fingerprint of its config with
the one kept beside the records (:func:`sidecar_path`, written before the first record) and
refuses on a difference, or when there is none (``--force-resume`` overrides either).

Every key of the config schema is in one of two tables: :data:`FINGERPRINT_KEYS` (what changes
a record's tokens or scores: the model, its dtype, device kind and quantization, the attention
and linear backends, which dataset and how it is read and how rows are identified, the whole
``prompt`` and ``generation`` sections with sampler plugin options and defaults filled, the
engine seed, the output format) or :data:`NOT_FINGERPRINTED` (with the reason: what only selects
rows or changes speed without changing a bit, where records go, metrics). A test walks the
schema and fails on a key in neither table, so a new setting must be classified.

A key recorded on one side and not the other is a difference (a sidecar of ``{"config": {}}``
does not switch the check off), with one exception so that an upgrade does not refuse a resume:
a sidecar without :data:`SIDECAR_VERSION` was written by an older batchgen, which had no such
setting and so ran as its default does; there a key it does not record is a difference only when
its value now is not the schema's default (:func:`schema_defaults`). The sidecar also keeps :func:`source_digest`, the local
dataset's size and content hash, so that a dataset edited in place at the same path is refused.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

__all__ = ["FINGERPRINT_KEYS", "NOT_FINGERPRINTED", "SIDECAR_VERSION", "SidecarError", "config_differences",
           "fingerprint", "fingerprint_hash", "read_sidecar", "schema_defaults", "sidecar", "sidecar_path",
           "source_digest"]

#: The sidecar format this version writes. A sidecar without it comes from an older batchgen,
#: whose fingerprint covered fewer settings (see :func:`config_differences`' ``defaults``).
SIDECAR_VERSION = 2

#: Dotted keys of the resolved config (a whole section, or one key of one) in the fingerprint.
FINGERPRINT_KEYS: tuple[str, ...] = (
    "model.name",
    "model.dtype",
    "model.device",  # its kind: 'auto' dtype is float32 on the CPU, the checkpoint's on a GPU
    "model.aliases",
    "model.adapters",  # the LoRA adapters a sweep runs (generation.adapters, fingerprinted, picks them)
    "data.source",
    "data.format",
    "data.name",
    "data.split",
    "data.id_column",
    "prompt",
    "generation",
    "engine.seed",
    "engine.quantization",  # quantized blocks and de-quantized weights give other logits
    "engine.kv_cache_dtype",  # a 16-bit cache rounds K/V: other logits
    "engine.attention_backend",  # torch's SDPA rounds differently from batchgen's kernels
    "engine.linear_backend",  # MKL's GEMM blocking differs from batchgen's (docs/kernels.md)
    "engine.tokenizer",  # another tokenizer gives other prompt ids
    "engine.max_model_len",  # caps where generation stops (finish_reason 'length')
    "engine.enable_lora",  # the projections are wrapped for adapters
    "output.format",
)

_SAME_BITS = ("on the default CPU path, bitwise the same records whatever its value (docs/kernels.md, "
              "'Reproducibility'; the torch backends, fingerprinted, differ in a row's last bits with the batch anyway)")
#: Keys of the config schema left out of the fingerprint, and why.
NOT_FINGERPRINTED: dict[str, str] = {
    "data.limit": "selects rows; a row's record does not depend on which others are taken",
    "data.shuffle": "selects rows (ids come from the unshuffled order)",
    "data.seed": "selects rows (the shuffle's seed)",
    "engine.block_size": "KV-cache layout: the kernels sum a row's context in token order whatever the block "
                         "size (not in the reproducibility test's list)",
    "engine.kv_cache_memory": f"KV budget (preemption recomputes): {_SAME_BITS}",
    "engine.max_num_seqs": f"batch size: {_SAME_BITS}",
    "engine.max_num_batched_tokens": f"prefill chunking: {_SAME_BITS}",
    "engine.enable_prefix_caching": f"prefix cache: {_SAME_BITS}",
    "engine.scheduling_policy": f"queue order: {_SAME_BITS}",
    "engine.num_threads": f"threads: {_SAME_BITS}",
    "engine.index_checks": "only checks indices before a launch",
    "engine.max_logprobs": "an upper bound checked before the run; generation.logprobs, fingerprinted, sets what is kept",
    "engine.max_loras": f"how many adapters run at once (the LoRA kernel is row-invariant): {_SAME_BITS}",
    "engine.max_lora_rank": "an upper bound checked when an adapter loads; the adapter (model.adapters) is fingerprinted",
    "engine.tensor_parallel_size": "only 1 runs (a larger value is refused), so it cannot differ between runs",
    "engine.gpu_memory_utilization": f"KV budget on a GPU (preemption recomputes): {_SAME_BITS}",
    "executor": "where the engine runs; every replica runs the same engine settings",
    "metrics": "score records; the summary aggregates each metric over the records that carry it",
    "output.path": "where the records go",
    "output.if_exists": "what to do with an existing file",
    "output.summary_path": "where the summary goes",
    "output.error_path": "where failed records go",
    "plugins": "which modules are imported; what a run uses of them (generation.sampler) is fingerprinted",
}

#: How a fingerprinted value is compared, where not as written.
_NORMALIZE: dict[str, Callable[[Any], Any]] = {
    "model.device": lambda value: value.partition(":")[0] if isinstance(value, str) else value,  # cuda:1 = cuda
}

#: How many bytes a digest reads at most: files are hashed whole while they fit in it; a file
#: that does not is hashed by its first and last ``_SAMPLE`` bytes, its size and its mtime
#: (reading gigabytes at every resume would be slow).
_HASH_BUDGET = 256 << 20
_SAMPLE = 1 << 20

_MISSING = "(not recorded)"


class SidecarError(ValueError):
    """The sidecar exists but is damaged (not JSON, or no ``config`` object in it)."""


def fingerprint(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprinted values of a resolved config, one level deep: ``{"generation.n": 4,
    "generation.sampler": {"name": ..., "options": {...}}, "model.name": ..., ...}``.

    Keys missing from ``config`` are left out (:func:`config_differences` counts them).
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
                flat[key] = _NORMALIZE.get(key, lambda value: value)(node)
    return flat


def fingerprint_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of :func:`fingerprint` (written in the run summary)."""
    blob = json.dumps(fingerprint(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def config_differences(before: Mapping[str, Any], now: Mapping[str, Any], *,
                       defaults: Mapping[str, Any] | None = None) -> list[str]:
    """``key: <before> before, <now> now`` for every fingerprinted key whose value changed,
    or that one side records and the other does not (shown as ``(not recorded)``).

    ``defaults`` (:func:`schema_defaults`, given for a sidecar of an older batchgen): a key that
    ``before`` does not record counts as that default, the value the older version ran with."""
    old, new = fingerprint(before), fingerprint(now)
    for key, value in (defaults or {}).items():
        if key in new and key not in old and _covered(key):
            old[key] = value

    def shown(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else _MISSING

    return [
        f"{key}: {shown(old, key)} before, {shown(new, key)} now"
        for key in sorted(old.keys() | new.keys())
        if key not in old or key not in new or old[key] != new[key]
    ]


def _covered(key: str) -> bool:
    return any(key == entry or key.startswith(entry + ".") for entry in FINGERPRINT_KEYS)


def schema_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """``section.key`` -> its default as the resolved config dumps it (JSON mode), for every key
    of each section of ``model`` (the run config's schema) that has a default."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        for key, inner in section.model_fields.items():
            if inner.is_required():
                continue
            try:
                value = inner.get_default(call_default_factory=True)
                found[f"{field.alias or name}.{inner.alias or key}"] = TypeAdapter(inner.annotation).dump_python(
                    value, mode="json")
            except Exception:  # noqa: BLE001 - a default that does not dump is simply not tolerated
                continue
    return found


def sidecar_path(output: str | Path) -> Path:
    """Where the config of an output's records is kept: ``results.jsonl`` ->
    ``results.jsonl.resume.json`` (beside the records, whatever ``output.summary_path`` says)."""
    output = Path(output)
    return output.with_name(output.name + ".resume.json")


def read_sidecar(output: str | Path) -> dict[str, Any] | None:
    """The sidecar of ``output`` (``{"config": {...}, "dataset": ...}``), or None when there is
    none.

    Raises:
        SidecarError: it exists but cannot be read, is not JSON, or holds no ``config`` object.
    """
    path = sidecar_path(output)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SidecarError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SidecarError(f"{path} is damaged: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise SidecarError(f"{path} is damaged: it holds no 'config' object")
    return data


def sidecar(resolved: Mapping[str, Any], dataset: Any = None) -> dict[str, Any]:
    """The sidecar's content for a run of ``resolved`` over a source of digest ``dataset``
    (written by the plan, atomically)."""
    return {"version": SIDECAR_VERSION, "fingerprint": fingerprint_hash(resolved), "config": dict(resolved),
            "dataset": dataset}


def source_digest(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """What the local dataset at ``path`` holds, cheaply: ``{"bytes": N, "sha256": ...}`` over
    its file, or over every file of its folder (names included). None for a source that is not
    a local path (a hub dataset: its content is not checked)."""
    if path is None:
        return None
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file())
    else:
        return None
    digest, total, sampled, budget = hashlib.sha256(), 0, False, _HASH_BUDGET
    for file in files:
        stat = file.stat()
        total += stat.st_size
        digest.update(f"{file.relative_to(root).as_posix() if file != root else ''}\0{stat.st_size}\0".encode())
        whole = stat.st_size <= budget
        budget -= stat.st_size if whole else min(2 * _SAMPLE, stat.st_size)
        _hash_file(digest, file, stat, whole)
        sampled |= not whole
    result: dict[str, Any] = {"bytes": total, "sha256": digest.hexdigest()[:32]}
    if sampled:
        result["sampled"] = True  # a big file: its ends, size and mtime
    return result


def _hash_file(digest: Any, path: Path, stat: os.stat_result, whole: bool) -> None:
    """Feed ``path`` into ``digest``: whole, or its two ends and its mtime."""
    with open(path, "rb") as handle:
        if whole:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
            return
        digest.update(handle.read(_SAMPLE))
        handle.seek(max(stat.st_size - _SAMPLE, 0))
        digest.update(handle.read(_SAMPLE))
        digest.update(str(stat.st_mtime_ns).encode())
