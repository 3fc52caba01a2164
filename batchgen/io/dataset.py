"""Rows from HF ``datasets``: load, select, give ids, check UTF-8 and columns.

Contract:

* :func:`load_rows` returns a :class:`LoadedData`: the ``datasets.Dataset`` (after shuffle and
  limit) and, for every row, its id. Ids are strings; they come from ``data.id_column`` or are the
  row's index in the *unshuffled* dataset, so they are stable across shuffles and resumes. Ids
  must be unique (resume depends on it).
* Problems with the data as a whole (missing file, unknown split, missing column, duplicate ids,
  a line that is not valid JSON, bytes that are not valid UTF-8) raise :class:`DataError` or
  :class:`~batchgen.config.ConfigError`, naming the file and line where it can: the run cannot
  start, and ``batchgen validate`` reports the same error.
* A CSV file's id column is read as text, so ids such as ``007`` keep their leading zeros.
* Problems with one row are not this module's: :mod:`batchgen.io.prompts` turns them into
  error records.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import meta
from jinja2.sandbox import SandboxedEnvironment

from batchgen.config import ConfigError, ConfigIssue, DataSection, RunConfig, did_you_mean
from batchgen.suggest import path_suggestion

__all__ = [
    "DataError",
    "LoadedData",
    "check_columns",
    "load_rows",
    "resolve_source",
    "template_variables",
]

# File extension -> the ``datasets`` builder that reads it.
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".csv": "csv",
    ".csv.gz": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".arrow": "arrow",
}
# Files ``Dataset.save_to_disk`` writes; their presence marks a saved dataset folder.
_SAVED_MARKERS = ("state.json", "dataset_dict.json", "dataset_info.json")
# Template names that are not dataset columns.
_TEMPLATE_NAMES = frozenset({"row", "index"})


class DataError(Exception):
    """The dataset cannot be used (a config problem: the CLI exits with status 2)."""


@dataclass
class LoadedData:
    """The selected rows and their ids (``ids[i]`` belongs to ``dataset[i]``)."""

    dataset: Any  # datasets.Dataset
    ids: list[str]
    indices: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)


# --------------------------------------------------------------------------- loading


def resolve_source(source: str) -> str:
    """Expand ``package:<pkg>/<relative path>`` to the file inside the installed package.

    The package is located with ``importlib.util.find_spec`` and is not imported. Other values
    are returned with ``~`` expanded.
    """
    if not source.startswith("package:"):
        return os.path.expanduser(source)
    package, _, relative = source[len("package:") :].partition("/")
    if not package or not relative:
        raise DataError(f"data.source '{source}': expected 'package:<package>/<path inside it>'")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data.source '{source}': package '{package}' is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise DataError(f"data.source '{source}': {path} does not exist")
    return str(path)


def _builder_for(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for suffix, builder in sorted(_BUILDERS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return builder
    raise DataError(
        f"data.source {path}: cannot tell the format from the file name; set data.format to one of "
        "'json', 'csv', 'parquet', 'text', 'arrow'"
    )


def _pick_split(dataset: Any, split: str, where: str) -> Any:
    """Return ``dataset[split]`` for a DatasetDict, or ``dataset`` itself."""
    # deferred: HF datasets (~5 s, pyarrow) only when rows are loaded
    import datasets

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(dataset.keys())
        if split not in splits:
            raise DataError(
                f"{where}: no split '{split}'{did_you_mean(split, splits)}; splits: {', '.join(splits)}"
            )
        return dataset[split]
    return dataset


def _load_dataset(cfg: DataSection) -> Any:
    # deferred: HF datasets (~5 s, pyarrow) only when rows are loaded
    import datasets

    datasets.disable_progress_bars()
    source = resolve_source(cfg.source)
    path = Path(source)
    verbosity = datasets.logging.get_verbosity()
    # datasets logs a parse error itself before raising; the DataError below says it once.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        if path.is_dir() and (cfg.format == "arrow" or any((path / m).exists() for m in _SAVED_MARKERS)):
            return _pick_split(datasets.load_from_disk(str(path)), cfg.split, f"data.source {path}")
        if path.is_dir():
            if cfg.format == "auto":
                return datasets.load_dataset(str(path), split=cfg.split)
            return datasets.load_dataset(cfg.format, data_dir=str(path), split=cfg.split)
        if path.is_file():
            builder = _builder_for(path, cfg.format)
            extra: dict[str, Any] = {}
            if builder == "csv" and cfg.id_column is not None:
                extra["converters"] = {cfg.id_column: str}  # ids are text: keep "007" as it is
            return datasets.load_dataset(builder, data_files={cfg.split: str(path)}, split=cfg.split, **extra)
        if source.startswith(("/", "./", "../")) or any(source.lower().endswith(s) for s in _BUILDERS):
            raise DataError(f"data.source: file not found: {source}{path_suggestion(path)}")
        # Otherwise a hub dataset (works when it is cached or the hub is reachable).
        try:
            return datasets.load_dataset(source, cfg.name, split=cfg.split)
        except Exception as exc:  # noqa: BLE001 - not local, and the hub did not give it either
            raise DataError(f"data.source '{cfg.source}': no such local path or dataset on the Hub"
                            f"{path_suggestion(path)}: {_root_cause(exc)}") from None
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; all mean "cannot load"
        where = f"data.source '{cfg.source}'"
        bad_line = _first_bad_json_line(path, cfg.format)
        if bad_line is not None:
            raise DataError(f"{where}: line {bad_line[0]} of {path} is not valid JSON: {bad_line[1]}") from None
        raise DataError(f"{where}: could not load the dataset: {_root_cause(exc)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost error that says something (datasets wraps the parser's
    error in "An error occurred while generating the dataset")."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    for error in reversed(chain):
        text = str(error).strip()
        if text:
            name = type(error).__name__
            return f"{name}: {text.splitlines()[0]}" if error is not exc else text.splitlines()[0]
    return type(exc).__name__


def _open_text(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _format_of(path: Path, fmt: str) -> str | None:
    """The builder that reads the local file ``path``, or None (not a file, unknown suffix)."""
    if not path.is_file():
        return None
    try:
        return _builder_for(path, fmt)
    except DataError:
        return None


def _first_bad_json_line(path: Path, fmt: str) -> tuple[int, str] | None:
    """``(line number, parse error)`` of the first line of a JSON-lines file that is not JSON.

    None when every line parses, or when the file is not JSON lines (e.g. one JSON array).
    """
    if _format_of(path, fmt) != "json":
        return None
    try:
        with _open_text(path) as f:
            for number, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line:
                    continue
                if number == 1 and line.startswith(b"["):
                    return None
                try:
                    value = json.loads(line)
                except UnicodeDecodeError:
                    return None  # reported by the UTF-8 check, with the byte
                except json.JSONDecodeError as exc:
                    return number, f"{exc.msg} (column {exc.colno})"
                except ValueError as exc:
                    return number, str(exc)
                surrogate = _lone_surrogate(value)
                if surrogate is not None:
                    return number, (f"it holds a lone surrogate \\u{ord(surrogate):04x} (half of a UTF-16 pair), "
                                    "which is not text; fix or remove that escape")
    except OSError:
        return None
    return None


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate (U+D800..U+DFFF) in the strings of a parsed JSON value, or None.

    Python's json accepts ``"\\ud800"`` alone; Arrow's JSON reader (and UTF-8) does not.
    """
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return found.group() if found else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key) if isinstance(key, str) else None
        found = found or _lone_surrogate(item)
        if found is not None:
            return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")
_ARROW_UTF8 = re.compile(r"Column (\d+): In chunk (\d+): Invalid: Invalid UTF8 sequence at string index (\d+)")


def _check_utf8(dataset: Any, cfg: DataSection) -> None:
    """Raise :class:`DataError` naming the file and line (or the row and column) of text that
    is not valid UTF-8; one scan of the Arrow table, in C."""
    # deferred: pyarrow (~0.8 s) only when rows are loaded
    import pyarrow as pa

    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is None:
        return
    try:
        table.validate(full=True)
        return
    except pa.ArrowInvalid as exc:
        message = str(exc)
    where = f"data.source '{cfg.source}'"
    path = Path(resolve_source(cfg.source))
    if _format_of(path, cfg.format) in ("json", "csv", "text"):  # a text file: name the line
        try:
            with _open_text(path) as f:
                for number, raw in enumerate(f, start=1):
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as err:
                        byte = raw[err.start : err.start + 1].hex()
                        raise DataError(
                            f"{where}: line {number} of {path} is not valid UTF-8 (byte 0x{byte} at "
                            f"column {err.start + 1}); fix or remove that line, or re-encode the file as UTF-8"
                        ) from None
        except OSError:
            pass
    found = _ARROW_UTF8.search(message)
    if found is None:
        raise DataError(f"{where}: the dataset is damaged: {message}")
    column, chunk, index = (int(g) for g in found.groups())
    row = sum(len(c) for c in table.column(column).chunks[:chunk]) + index
    raise DataError(
        f"{where}: row {row}, column '{table.column_names[column]}' is not valid UTF-8; fix that row "
        "or re-encode the data as UTF-8"
    )


def load_rows(cfg: DataSection) -> LoadedData:
    """Load the dataset, shuffle and limit it, and assign each row its id."""
    dataset = _load_dataset(cfg)
    _check_utf8(dataset, cfg)
    total = len(dataset)
    order = list(range(total))
    if cfg.shuffle:
        # Our own permutation (not Dataset.shuffle) so that the selection only depends on the
        # seed and the dataset's length, whatever the datasets version.
        random.Random(cfg.seed).shuffle(order)
    if cfg.limit is not None:
        order = order[: cfg.limit]
    if order != list(range(total)):
        dataset = dataset.select(order)
    if cfg.id_column is None:
        ids = [str(i) for i in order]
    else:
        if cfg.id_column not in dataset.column_names:
            raise _missing_column(cfg.id_column, "data.id_column", dataset.column_names)
        ids = []
        first_seen: dict[str, int] = {}
        for position, value in enumerate(dataset[cfg.id_column]):
            if value is None or value == "":
                raise DataError(f"data.id_column '{cfg.id_column}': row {order[position]} has an empty id")
            key = str(value)
            if key in first_seen:
                raise DataError(
                    f"data.id_column '{cfg.id_column}': id {key!r} is not unique "
                    f"(rows {first_seen[key]} and {order[position]}); resume needs unique ids"
                )
            first_seen[key] = order[position]
            ids.append(key)
    return LoadedData(dataset=dataset, ids=ids, indices=order)


# --------------------------------------------------------------------------- columns


def _missing_column(column: str, key: str, columns: Sequence[str]) -> ConfigError:
    return ConfigError([_missing_issue(column, key, columns)])


def _missing_issue(column: str, key: str, columns: Sequence[str]) -> ConfigIssue:
    listed = ", ".join(f"'{c}'" for c in columns)
    return ConfigIssue(key, f"column '{column}' is not in the dataset{did_you_mean(column, columns)}; columns: {listed}")


def template_variables(template: str) -> set[str]:
    """The names a template reads from its context (columns, ``row``, ``index``)."""
    env = SandboxedEnvironment()
    return set(meta.find_undeclared_variables(env.parse(template)))


def check_columns(columns: Sequence[str], config: RunConfig, metric_columns: dict[str, Iterable[str]] | None = None) -> None:
    """Raise one :class:`ConfigError` listing every column the config needs but the data lacks.

    ``metric_columns`` maps a metric's config key to the columns its ``score`` reads.
    """
    issues = []
    column = config.prompt.prompt_column
    if column is not None and column not in columns:
        issues.append(_missing_issue(column, "prompt.column", columns))
    if config.prompt.template is not None:
        for name in sorted(template_variables(config.prompt.template) - _TEMPLATE_NAMES):
            if name not in columns:
                issues.append(_missing_issue(name, "prompt.template", columns))
    if config.data.id_column is not None and config.data.id_column not in columns:
        issues.append(_missing_issue(config.data.id_column, "data.id_column", columns))
    for position, metric in enumerate(config.metrics):
        for name in (metric_columns or {}).get(metric.key, ()):
            if name not in columns:
                issue = _missing_issue(name, f"metrics.{position}", columns)
                issues.append(ConfigIssue(issue.path, f"metric '{metric.name}' reads {issue.message}"))
    if issues:
        raise ConfigError(issues)
