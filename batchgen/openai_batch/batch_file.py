"""The OpenAI Batch input file: :class:`BatchFile` (its lines, read lazily, each answered
exactly once across kills and resumes) and :class:`AnsweredOnDisk` (what the outputs already
answer, on disk), with the envelope check of one raw line.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, RunConfig
from batchgen.io.protocols import ResumeIndex
from batchgen.openai_batch.errors import DUPLICATE_CUSTOM_ID, LINE_FIELDS, LineError
from batchgen.openai_batch.requests import BatchPrompt, LineParser
from batchgen.io.dataset import DataError, resolve_source


class AnsweredOnDisk:
    """What a previous run already answered, kept on disk (see the module's resume contract): a
    :class:`~batchgen.io.protocols.ResumeIndex`, as :class:`~batchgen.io.protocols.AnsweredKeys`
    is one in memory.

    ``answered`` custom_ids sit in a temporary SQLite table; ``keyless`` counts the answered
    lines whose key is None (no usable custom_id, or a duplicate).
    """

    def __init__(self) -> None:
        # "" opens a private temporary database on disk: its pages spill to a file, not to RAM.
        self._db = sqlite3.connect("")
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE answered (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")
        self.num_answered = 0
        self.keyless = 0

    def add(self, key: str | None) -> None:
        """Count one answered record whose resume key is ``key`` (None: a keyless one)."""
        if key is None:
            self.keyless += 1
        else:
            self.num_answered += self._db.execute("INSERT OR IGNORE INTO answered VALUES (?)", (key,)).rowcount

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], str | None]) -> AnsweredOnDisk:
        """The index of ``records`` (every output file's, in file order) under ``key``."""
        index = cls()
        for record in records:
            index.add(key(record))
        return index

    def __len__(self) -> int:
        return self.num_answered + self.keyless

    def __contains__(self, custom_id: object) -> bool:
        if not self.num_answered:
            return False
        return self._db.execute("SELECT 1 FROM answered WHERE id = ?", (custom_id,)).fetchone() is not None

    def first_line(self, custom_id: str, line: int) -> int | None:
        """Record that ``custom_id`` was read on ``line``; return the line it was first read on
        if this is a repeat, else None."""
        if self._db.execute("INSERT OR IGNORE INTO seen VALUES (?, ?)", (custom_id, line)).rowcount:
            return None
        return self._db.execute("SELECT line FROM seen WHERE id = ?", (custom_id,)).fetchone()[0]

    def close(self) -> None:
        self._db.close()


class BatchFile:
    """An OpenAI batch input file, read lazily (``data.format: openai_batch``).

    ``len()`` is the number of non-blank lines a run reads (``data.limit`` applied); it is
    counted by scanning the file once, without parsing it.
    """

    def __init__(self, path: str | Path, limit: int | None = None) -> None:
        self.path = Path(path)
        self.limit = limit
        self._count: int | None = None

    @property
    def columns(self) -> list[str]:
        return list(LINE_FIELDS)

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """``(index, raw line)`` of every non-blank line, in order; ``index`` counts from 0 over
        all lines, so ``index + 1`` is the line number an editor shows."""
        taken = 0
        with open(self.path, "rb") as f:
            for index, raw in enumerate(f):
                if not raw.strip():
                    continue
                if self.limit is not None and taken >= self.limit:
                    return
                taken += 1
                yield index, raw

    def __len__(self) -> int:
        if self._count is None:
            count = 0
            with open(self.path, "rb") as f:
                for raw in f:
                    count += bool(raw.strip())
            self._count = count if self.limit is None else min(count, self.limit)
        return self._count

    def todo(self, done: ResumeIndex) -> int:
        """Lines this run still has to answer."""
        return max(len(self) - len(done), 0)

    def prompts(self, parser: LineParser, done: ResumeIndex) -> Iterator[BatchPrompt]:
        """Every line not answered yet, as a :class:`BatchPrompt`, in file order.

        ``done`` is what the outputs answer (``custom_id in done``, and ``done.keyless``). Lines
        that cannot run come with ``error`` set; answered ones are skipped before their body is
        parsed, so a resume reads through the done part of the file quickly. The custom_ids read
        are kept in a private on-disk table, to find duplicates.
        """
        keyless = 0
        seen = AnsweredOnDisk()
        for index, raw in self.lines():
            custom_id, line, problem = _envelope(raw)
            first = seen.first_line(custom_id, index) if custom_id is not None else None
            if custom_id is None or first is not None:
                keyless += 1
                if keyless <= done.keyless:
                    continue
                prompt = BatchPrompt(id=None, index=index, row=line or {}, custom_id=custom_id)  # type: ignore[arg-type]
                if problem is None:
                    assert first is not None
                    problem = LineError(f"Duplicate custom_id {json.dumps(custom_id)}: it was first used on line "
                                        f"{first + 1}; each line needs its own custom_id.", "custom_id",
                                        DUPLICATE_CUSTOM_ID)
                prompt.error, prompt.error_param, prompt.error_code = problem.message, problem.param, problem.code
                prompt.error = f"line {index + 1}: {prompt.error}"
                yield prompt
                continue
            if custom_id in done:
                continue
            assert line is not None
            yield parser.parse(line, custom_id, index)


    def preview(self, tokenizer: Any, model_names: Iterable[str], lines: int) -> list[str]:
        """Why each of the first ``lines`` lines would fail, for ``batchgen validate`` (which loads
        no model: the context length is not checked). Without a tokenizer only the line's
        envelope (JSON, ``custom_id``) is checked."""
        parser = LineParser(tokenizer, 2**62, model_names) if tokenizer is not None else None
        problems = []
        seen: dict[str, int] = {}
        for index, raw in islice(self.lines(), lines):
            custom_id, line, problem = _envelope(raw)
            if custom_id is not None and custom_id in seen:
                problem = LineError(f"duplicate custom_id: it was first used on line {seen[custom_id] + 1}")
            elif custom_id is not None:
                seen[custom_id] = index
            if problem is None and parser is not None and line is not None and custom_id is not None:
                prompt = parser.parse(line, custom_id, index)
                if prompt.error is not None:
                    problem = LineError(prompt.error, prompt.error_param, prompt.error_code)
            if problem is not None:
                who = f" (custom_id {json.dumps(custom_id)})" if custom_id is not None else ""
                problems.append(f"line {index + 1}{who}: {problem.message}")
        return problems


def _envelope(raw: bytes) -> tuple[str | None, dict[str, Any] | None, LineError | None]:
    """``(custom_id, line, problem)`` of one raw line; custom_id is None when unusable."""
    try:
        line = json.loads(raw)
    except UnicodeDecodeError as exc:
        return None, None, LineError(f"the line is not valid UTF-8 ({exc.reason} at byte {exc.start})", None,
                                     "invalid_json")
    except ValueError as exc:
        return None, None, LineError(f"the line is not valid JSON: {exc}", None, "invalid_json")
    if not isinstance(line, dict):
        return None, None, LineError(f"the line must be a JSON object, got {type(line).__name__}", None,
                                     "invalid_json")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        why = "is missing" if "custom_id" not in line else f"must be a non-empty string, got {json.dumps(custom_id)}"
        return None, line, LineError(f"'custom_id' {why}", "custom_id", "invalid_value")
    return custom_id, line, None


def open_input(config: RunConfig, metric_columns: dict[str, Iterable[str]] | None = None) -> BatchFile:
    """The batch file of ``data.source``.

    Raises :class:`DataError` when it cannot be read, and :class:`ConfigError` for a metric
    that reads a column a batch line does not have (``metric_columns``: metric key -> columns).
    """
    data = config.data
    issues = [
        ConfigIssue(f"metrics.{i}", f"metric '{ref.name}' reads column '{name}', which an OpenAI batch line "
                    f"does not have; columns: {', '.join(LINE_FIELDS)}")
        for i, ref in enumerate(config.metrics)
        for name in (metric_columns or {}).get(ref.key, ())
        if name not in LINE_FIELDS
    ]
    if issues:
        raise ConfigError(issues)
    path = Path(resolve_source(data.source))
    if not path.is_file():
        raise DataError(f"data.source: OpenAI batch file not found: {path}")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise DataError(f"data.source: cannot read {path}: {exc.strerror or exc}") from None
    return BatchFile(path, data.limit)
