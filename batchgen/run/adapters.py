"""The adapter sweep of a YAML job: every row under each adapter of ``generation.adapters``
(LoRA adapters named in ``model.adapters``, and ``base``), in one run.

:func:`sweep` wraps the job's prompt source and record format (any kind): the source yields
each row once per adapter (the row's copies one after the other, so an adapter's rows share
the steps with the others'), tagged with the adapter's ``LoRARequest``; each record carries
``"adapter"``, and resume keys are ``(row id, adapter)``, so a resumed run computes only the
pairs not yet written. A bad adapter (a missing folder, a rank too high, another base model's
shapes) fails its own rows with the engine's error naming it; the rest of the job runs.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, RunConfig
from batchgen.config.formats import BATCH_LINES, kinds
from batchgen.io.output_file import read_records
from batchgen.io.protocols import AnsweredKeys, EngineView, Preview, PromptRecord, PromptSource, RecordFormat, ResumeIndex
from batchgen.lora.request import LoRARequest

__all__ = ["BASE", "adapter_metrics", "adapter_paths", "adapter_table", "sweep"]

BASE = "base"  #: the model without an adapter, in ``generation.adapters``
_SEP = "\x1f"  # between a row id and an adapter name in a resume key and a request id


def adapter_paths(config: RunConfig) -> dict[str, str]:
    """``model.adapters`` as name -> folder: the map as given, or each folder the glob matches,
    named by its folder name, in sorted order.

    Raises:
        ConfigError: a glob that matches no folder, two folders of one name, or ``base`` as a name.
    """
    given = config.model.adapters
    if isinstance(given, str):
        folders = sorted(p for p in glob.glob(given) if Path(p).is_dir())
        if not folders:
            raise ConfigError([ConfigIssue("model.adapters", f"the glob {given!r} matches no folder; give a "
                                           "glob of checkpoint folders such as 'runs/lora/checkpoint-*'")])
        paths = {Path(p).name: p for p in folders}
        if len(paths) != len(folders):
            raise ConfigError([ConfigIssue("model.adapters", f"the glob {given!r} matches folders of the same "
                                           "name; give a map of names to folders instead")])
    else:
        paths = dict(given or {})
    if BASE in paths:
        raise ConfigError([ConfigIssue("model.adapters", f"{BASE!r} names the model without an adapter; "
                                       "give the adapter another name")])
    return paths


def sweep(config: RunConfig, source: PromptSource, records: RecordFormat) -> tuple[PromptSource, RecordFormat]:
    """The job's source and records, swept over its adapters (unchanged without any).

    Raises:
        ConfigError: ``generation.adapters`` naming an adapter that ``model.adapters`` lacks.
    """
    if not config.model.adapters and not config.generation.adapters:
        return source, records
    paths = adapter_paths(config)
    if kinds(config)[0] is BATCH_LINES:
        return _by_line_model(config, source, paths), records
    names = list(config.generation.adapters or paths)
    unknown = [n for n in names if n != BASE and n not in paths]
    if unknown:
        known = ", ".join([BASE, *paths])
        raise ConfigError([ConfigIssue("generation.adapters", f"no adapter {', '.join(map(repr, unknown))} in "
                                       f"model.adapters (known: {known})")])
    loras = {n: None if n == BASE else LoRARequest(n, _lora_id(paths[n]), str(paths[n])) for n in dict.fromkeys(names)}
    return AdapterRows(source, loras), AdapterRecords(records)


def _by_line_model(config: RunConfig, source: Any, paths: Mapping[str, str]) -> PromptSource:
    """An OpenAI batch file's lines under the adapter their ``model`` names (``--lora NAME=PATH``,
    as ``vllm serve --lora-modules``); the model's own names run the base model."""
    if config.generation.adapters:
        raise ConfigError([ConfigIssue("generation.adapters", "an OpenAI batch line picks its adapter by its "
                                       "'model'; drop generation.adapters (--lora NAME=PATH names them)")])
    source.model_names = [*source.model_names, *paths]  # the line parser answers these names
    loras = {name: LoRARequest(name, _lora_id(path), str(path)) for name, path in paths.items()}
    return LineAdapters(source, loras)


class LineAdapters:
    """A batch file's lines, each under the adapter its body's ``model`` names (if any)."""

    def __init__(self, source: PromptSource, loras: Mapping[str, LoRARequest]) -> None:
        self.source, self.loras = source, dict(loras)

    def __len__(self) -> int:
        return len(self.source)

    def todo(self, answered: ResumeIndex) -> int:
        return self.source.todo(answered)

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        for prompt in self.source.prompts(engine, answered):
            body = prompt.row.get("body") if isinstance(prompt.row, dict) else None
            model = body.get("model") if isinstance(body, dict) else None
            if prompt.error is None and isinstance(model, str) and model in self.loras:
                prompt.lora_request = self.loras[model]
            yield prompt

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        return self.source.preview(tokenizer, rows)


_IDS: dict[str, int] = {}  # adapter folder -> its lora_int_id, for the process


def _lora_id(path: str) -> int:
    """One id per adapter folder for the whole process, so that jobs run on one engine (the
    CLI's, or a test's) never give two folders one id (ids are not written anywhere)."""
    key = str(Path(path).resolve())
    return _IDS.setdefault(key, len(_IDS) + 1)


class _Answered:
    """A row id counts as answered when ``(id, adapter)`` is, for every one of ``names``."""

    def __init__(self, answered: ResumeIndex, names: Iterable[str]) -> None:
        self.answered, self.names = answered, list(names)

    def __contains__(self, row_id: object) -> bool:
        return all(f"{row_id}{_SEP}{n}" in self.answered for n in self.names)


class AdapterRows:
    """A prompt source yielding each of ``source``'s rows once per adapter (see the module
    docstring); ``loras`` maps each adapter name to its LoRARequest (None for ``base``)."""

    def __init__(self, source: PromptSource, loras: Mapping[str, LoRARequest | None]) -> None:
        self.source, self.loras = source, dict(loras)

    def __len__(self) -> int:
        return len(self.source) * len(self.loras)

    def todo(self, answered: ResumeIndex) -> int:
        return sum(self.source.todo(_Answered(answered, [n])) for n in self.loras)

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        for prompt in self.source.prompts(engine, _Answered(answered, self.loras)):
            for name, lora in self.loras.items():
                if f"{prompt.id}{_SEP}{name}" not in answered:
                    yield _tagged(prompt, name, lora)

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        preview = self.source.preview(tokenizer, rows)
        preview.checked += f", each under {len(self.loras)} adapter(s): {', '.join(self.loras)}"
        return preview


def _tagged(prompt: PromptRecord, name: str, lora: LoRARequest | None) -> PromptRecord:
    """``prompt`` under adapter ``name``: its id (and its requests' ids) made unique per
    adapter, the row's own id kept in ``meta``."""
    meta = {**prompt.meta, "adapter": name, "row_id": prompt.id}
    requests = None
    if prompt.requests is not None:
        requests = [dataclasses.replace(r, request_id=f"{r.request_id}{_SEP}{name}", lora_request=lora)
                    for r in prompt.requests]
    key = None if prompt.id is None else f"{prompt.id}{_SEP}{name}"
    return dataclasses.replace(prompt, id=key, meta=meta, requests=requests, lora_request=lora)


class _Builder:
    """The inner format's records, each with the row's own id and its ``adapter``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def make(self, prompt: PromptRecord, output: Any) -> dict[str, Any]:
        row = dataclasses.replace(prompt, id=prompt.meta.get("row_id", prompt.id))
        record = self.inner.make(row, output)
        return {"id": record.get("id"), "adapter": prompt.meta.get("adapter"), **record}


class AdapterRecords:
    """``records`` (any record format) with an ``adapter`` per record, keyed by (row, adapter)."""

    def __init__(self, records: RecordFormat) -> None:
        self.records = records

    def builder(self, engine: EngineView) -> _Builder:
        return _Builder(self.records.builder(engine))

    def key(self, record: Mapping[str, Any]) -> str | None:
        row = self.records.key(record)
        return None if row is None else f"{row}{_SEP}{record.get('adapter')}"

    def resume_index(self, records: Iterable[Mapping[str, Any]]) -> ResumeIndex:
        return AnsweredKeys.of(records, self.key)

    def failed(self, record: Mapping[str, Any]) -> bool:
        return self.records.failed(record)

    def output_tokens(self, record: Mapping[str, Any]) -> int:
        return self.records.output_tokens(record)

    def describe_error(self, record: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.records.describe_error(record), "adapter": record.get("adapter")}

    def example(self, described: Mapping[str, Any]) -> str:
        return f"adapter {described.get('adapter')!r}, {self.records.example(described)}"

    def summary_counts(self, counts: Mapping[str, Any]) -> dict[str, Any]:
        return self.records.summary_counts(counts)

    def __getattr__(self, name: str) -> Any:  # a format's extra attributes (e.g. a scoring mode)
        return getattr(self.records, name)


def adapter_metrics(job: Any) -> dict[str, Any]:
    """``{"metrics_by_adapter": {adapter: {metric key: aggregate}}}`` of a swept job's ok
    records (each metric aggregated over one adapter's records), or ``{}`` for another job."""
    if not isinstance(job.records, AdapterRecords) or not job.metrics:
        return {}
    scores: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in job.source.loras}
    for record in (r for path in job.outputs if Path(path).exists() for r in read_records(path)):
        if job.records.failed(record) or str(record.get("adapter")) not in scores:
            continue
        for ref, _ in job.metrics:
            value = (record.get("metrics") or {}).get(ref.key)
            if isinstance(value, dict):
                scores[str(record["adapter"])].setdefault(ref.key, []).append(value)
    return {"metrics_by_adapter": {
        name: {ref.key: metric.aggregate(per[ref.key]) for ref, metric in job.metrics if per.get(ref.key)}
        for name, per in scores.items()}}


def adapter_table(by_adapter: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """A Markdown table of ``metrics_by_adapter``: one row per metric value, one column per
    adapter."""
    names = list(by_adapter)
    rows: dict[str, dict[str, Any]] = {}
    for adapter, metrics in by_adapter.items():
        for key, values in metrics.items():
            for name, value in values.items():
                rows.setdefault(f"{key}.{name}", {})[adapter] = value
    cells = [[label, *(_cell(rows[label].get(n)) for n in names)] for label in rows]
    header = ["metric", *names]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))) + " |",
             "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
              for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
