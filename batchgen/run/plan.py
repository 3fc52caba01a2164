"""The plan of a run: every check that needs no model, then a ready :class:`Job`.

:func:`plan` builds the plugins with their options, builds the job's prompt source and record
format of the kinds the config picked (:func:`pick`; :func:`batchgen.config.formats.kinds` is
the only place that reads ``data.format`` and ``output.format``), loads
or opens the data, checks the output, and, unless only validating, takes the outputs' locks and
creates, truncates or repairs the files. Problems the user must fix raise one of
:data:`~batchgen.run.errors.SETUP_ERRORS` (exit status 2); config problems found by different
checks are reported together in one :class:`~batchgen.config.ConfigError`.

Outputs: never the input dataset (compared as resolved paths, symlinks followed, and as
inodes, so a hard link counts too, whatever ``if_exists`` says), never inside a dataset folder, always regular files (or new ones), and the
files batchgen keeps beside them (``.resume.json``, ``.lock``) not folders.

Resume: the config a file's records were written with is kept beside them
(:func:`batchgen.run.fingerprint.sidecar_path`, written before the first record), with the local
dataset's size and content hash. A resume whose fingerprinted config or dataset differs from it
is refused, and so is a resume of records without one (unless the earlier run's summary still
holds its config) or with a damaged one, all unless ``force_resume``. A refused resume changes
nothing: the files are checked and read before the torn tail is dropped.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from batchgen.config import ConfigError, ConfigIssue, MetricRef, RunConfig, resolved_dict
from batchgen.config.formats import BATCH_LINES, BATCHGEN_RECORDS, DATASET_ROWS, RESPONSE_LINES, kinds
from batchgen.config.formats import RecordKind, ScoringKind, SourceKind, scoring_kind
from batchgen.plugins import PluginError
from batchgen.run.adapters import sweep
from batchgen.run.errors import ResumeMismatchError
from batchgen.run.fingerprint import SIDECAR_VERSION, SidecarError, config_differences, read_sidecar, schema_defaults
from batchgen.run.fingerprint import sidecar, sidecar_path, source_digest
from batchgen.io.dataset import DataError, resolve_source
from batchgen.io.lock import OutputLock, lock_path
from batchgen.io.protocols import PromptSource, RecordFormat, ResumeIndex
from batchgen.io.output_file import OutputError, check_output, check_writable, prepare_output, read_records
from batchgen.io.output_file import read_summary, write_json_atomic
from batchgen.model_resolver import ModelError, QuantizationError, check_model
from batchgen.openai_batch.response_lines import ResponseLines
from batchgen.openai_batch.source import BatchLines
from batchgen.plugins import load_registry
from batchgen.run.executors import check_executor
from batchgen.run.records import BatchgenRecords
from batchgen.run.rows import DatasetRows
from batchgen.run.scoring_kinds import SCORERS
from batchgen.run.scoring_records import ScoringRecords
from batchgen.run.scoring_rows import ScoringRows

__all__ = ["Job", "output_paths", "pick", "plan"]

T = TypeVar("T")


@dataclass
class Job:
    """Everything :func:`batchgen.run.execute.execute` needs, checked and ready (see :func:`plan`)."""

    config: RunConfig
    registry: Any
    #: Where the rows come from, and what the records look like (see :mod:`batchgen.io.protocols`).
    source: PromptSource
    records: RecordFormat
    metrics: list[tuple[MetricRef, Any]]
    #: What the output files already answer (empty for a fresh run).
    answered: ResumeIndex
    config_path: str | None = None
    #: The resolved config (what the summary and the sidecar record).
    resolved: dict[str, Any] = field(default_factory=dict)
    #: The locks of the output files (the output, and the error file if any), held from
    #: :func:`plan` to the end of the run.
    locks: list[OutputLock] = field(default_factory=list)
    #: The summary of the run this one resumes (None for a fresh run).
    previous: dict[str, Any] | None = None
    #: The scoring kind of a scoring job (``generation.mode``), None for a generation job.
    scoring: ScoringKind | None = None
    #: What the local dataset holds (:func:`~batchgen.run.fingerprint.source_digest`), kept in
    #: the sidecar; None for a hub dataset, or before :func:`plan` prepared the files.
    dataset: dict[str, Any] | None = None

    def release(self) -> None:
        """Release the outputs' locks (idempotent; ``execute`` does it when it ends)."""
        for lock in self.locks:
            lock.release()

    @property
    def todo(self) -> int:
        """Rows this run still has to write."""
        return self.source.todo(self.answered)

    @property
    def outputs(self) -> list[str]:
        return output_paths(self.config)


def output_paths(config: RunConfig) -> list[str]:
    """The record files of a run: ``output.path``, then ``output.error_path`` when set."""
    return [p for p in (config.output.path, config.output.error_path) if p]


def pick(config: RunConfig, processors: Sequence[Any] = (),
         metric_columns: dict[str, Iterable[str]] | None = None,
         metrics: Sequence[tuple[MetricRef, Any]] = ()) -> tuple[PromptSource, RecordFormat]:
    """The job's prompt source and record format, of the kinds the config picked
    (:func:`batchgen.config.formats.kinds`, the only place that reads ``data.format`` and
    ``output.format``; the config applied the kinds' rules when it was validated).

    Building the source loads or opens the data (raises DataError / ConfigError).
    """
    source_kind, record_kind = kinds(config)
    scoring = scoring_kind(config.generation)
    if scoring is not None:  # generation.mode loglikelihood / perplexity: a scoring job
        return sweep(config, *_scoring(config, scoring, source_kind, record_kind, metric_columns, metrics))
    return sweep(config, _SOURCES[source_kind](config, processors, metric_columns),
                 _RECORDS[record_kind](config, metrics))  # sweep: model.adapters, if any


def _scoring(config: RunConfig, scoring: ScoringKind, source_kind: SourceKind, record_kind: RecordKind,
             metric_columns: dict[str, Iterable[str]] | None,
             metrics: Sequence[tuple[MetricRef, Any]]) -> tuple[PromptSource, RecordFormat]:
    """The scoring rows and records of a job of the kind ``scoring``, built by the kind's scorer
    (:data:`batchgen.run.scoring_kinds.SCORERS`; dataset rows and batchgen-style records only)."""
    if source_kind is not DATASET_ROWS:
        raise ConfigError([ConfigIssue("data.format", f"generation.mode '{config.generation.mode}' scores the rows "
                                       f"of a dataset; data.format '{config.data.format}' is not one")])
    if record_kind is not BATCHGEN_RECORDS:
        raise ConfigError([ConfigIssue("output.format", f"generation.mode '{config.generation.mode}' writes "
                                       f"batchgen records; use output.format '{BATCHGEN_RECORDS.name}' or 'auto'")])
    scorer = SCORERS[scoring]
    return ScoringRows(config, scorer, metric_columns), ScoringRecords(scorer, metrics)


# What each kind is built as.

def _dataset_rows(config: RunConfig, processors: Sequence[Any],
                  metric_columns: dict[str, Iterable[str]] | None) -> PromptSource:
    return DatasetRows(config, processors, metric_columns)


def _batch_lines(config: RunConfig, processors: Sequence[Any],
                 metric_columns: dict[str, Iterable[str]] | None) -> PromptSource:
    return BatchLines(config, processors, metric_columns)


def _batchgen_records(config: RunConfig, metrics: Sequence[tuple[MetricRef, Any]]) -> RecordFormat:
    return BatchgenRecords(metrics)


def _response_lines(config: RunConfig, metrics: Sequence[tuple[MetricRef, Any]]) -> RecordFormat:
    return ResponseLines(config)


_SOURCES: dict[SourceKind, Callable[..., PromptSource]] = {DATASET_ROWS: _dataset_rows, BATCH_LINES: _batch_lines}
_RECORDS: dict[RecordKind, Callable[..., RecordFormat]] = {BATCHGEN_RECORDS: _batchgen_records,
                                                           RESPONSE_LINES: _response_lines}


def _metric_refs(config: RunConfig) -> list[MetricRef]:
    """The job's metrics: ``metrics:``, or those a scoring job's kind implies when it lists none
    (:meth:`batchgen.config.formats.ScoringKind.implied_metrics`)."""
    scoring = scoring_kind(config.generation)
    if config.metrics or scoring is None:
        return list(config.metrics)
    return [MetricRef(name=name) for name in scoring.implied_metrics(config.generation)]


class _Issues:
    """Collects the config issues of several checks, to raise them together."""

    def __init__(self) -> None:
        self.issues: list[ConfigIssue] = []

    def run(self, check: Callable[[], T]) -> T | None:
        try:
            return check()
        except ConfigError as exc:
            self.issues += exc.issues
            return None

    def raise_any(self) -> None:
        if self.issues:
            raise ConfigError(self.issues)


def _configure_metrics(config: RunConfig, registry: Any, metrics: Sequence[tuple[MetricRef, Any]]) -> None:
    """Hand the resolved config to every metric that has ``configure`` (see
    :class:`batchgen.metrics.Metric`); its ValueError becomes a config error at ``metrics.<i>``."""
    resolved: dict[str, Any] | None = None
    issues = []
    for i, (ref, metric) in enumerate(metrics):
        configure = getattr(getattr(metric, "inner", metric), "configure", None)
        if not callable(configure):
            continue
        if resolved is None:
            resolved = resolved_dict(config, registry)
        try:
            configure(resolved)
        except ValueError as exc:
            issues.append(ConfigIssue(f"metrics.{i}", f"metric '{ref.name}': {exc}"))
        except Exception as exc:
            label = getattr(metric, "label", ref.name)
            raise PluginError(
                f"metric '{ref.name}' ({label}) could not be configured: {type(exc).__name__}: {exc}",
                plugin=getattr(metric, "plugin", None),
            ) from exc
    if issues:
        raise ConfigError(issues)


def check_model_name(name: str, quantization: str = "auto", device: str = "auto") -> None:
    """Raise a ConfigError at ``model.name`` for a model that cannot be found or loaded.

    Cheap for folders and cached hub ids; converts the embedded GGUF the first time only.
    """
    try:
        check_model(name, quantization, device)
    except ModelError as exc:
        key = "engine.quantization" if isinstance(exc, QuantizationError) else "model.name"
        raise ConfigError([ConfigIssue(key, str(exc))]) from None


def plan(
    config: RunConfig,
    registry: Any = None,
    *,
    prepare: bool = True,
    config_path: str | None = None,
    force_resume: bool = False,
) -> Job:
    """Check everything that needs no model and return a ready :class:`Job`.

    With ``prepare=False`` (``batchgen validate``) the output is only checked for writability and
    left untouched; otherwise the output's lock is taken, and the file is created, truncated
    (overwrite) or repaired (resume) per ``config.output.if_exists``, and the rows already in it
    are skipped. A resume whose fingerprinted config differs from the one its records were
    written with raises :class:`~batchgen.run.errors.ResumeMismatchError` unless ``force_resume``.

    Raises:
        one of :data:`~batchgen.run.errors.SETUP_ERRORS`.
    """
    if registry is None:
        registry = load_registry(config.plugins)
    found = _Issues()
    metrics = [(ref, registry.build_metric(ref.name, ref.options)) for ref in _metric_refs(config)]
    found.run(lambda: _configure_metrics(config, registry, metrics))
    processors = []
    if config.generation.sampler is not None:
        sampler = config.generation.sampler
        processors.append(registry.build_sampler(sampler.name, sampler.options))
    found.run(lambda: check_model_name(config.model.name, config.engine.quantization, config.model.device))
    found.run(lambda: check_executor(config))  # backend 'ray' without Ray installed: say what to install
    required = {ref.key: tuple(getattr(metric, "required_columns", ()) or ()) for ref, metric in metrics}
    picked = found.run(lambda: pick(config, processors, required, metrics))
    found.raise_any()
    assert picked is not None
    source, records = picked
    check_outputs(config)
    resolved = resolved_dict(config, registry)
    job = Job(config, registry, source, records, metrics, records.resume_index(()), config_path, resolved,
              scoring=scoring_kind(config.generation))
    if prepare:
        _prepare(job, force_resume)
    return job


def _local_source(config: RunConfig) -> Path | None:
    """The local file or folder ``data.source`` names, or None (a hub dataset)."""
    try:
        path = Path(resolve_source(config.data.source))
    except DataError:
        return None
    return path if path.exists() else None


def check_outputs(config: RunConfig) -> None:
    """Raise :class:`~batchgen.io.output_file.OutputError` for an output that is the input dataset
    (or lies inside its folder), that is not a regular file, that cannot be written, or whose
    ``.resume.json`` or ``.lock`` is a folder. Creates nothing."""
    named = [("output.path", config.output.path), ("output.error_path", config.output.error_path),
             ("output.summary_path", str(config.output.summary_file))]
    source = _local_source(config)
    for key, path in named:
        if path is None:
            continue
        if source is not None:
            target = Path(path).resolve()
            if target == source.resolve() or (target.is_file() and source.is_file() and target.samefile(source)):
                raise OutputError(f"the output is the input dataset: {key} {path} and data.source "
                                  f"{config.data.source} are the same file; write the output to another file")
            if source.is_dir() and source.resolve() in target.parents:
                raise OutputError(f"the output is inside the input dataset: {key} {path} is in the data.source "
                                  f"folder {config.data.source}, so the next run would read it as rows; "
                                  "write the output outside that folder")
        check_writable(path)
    for path in output_paths(config):
        kept = ((sidecar_path(path), "the config of its records") if path == config.output.path else None,
                (lock_path(path), "its lock"))
        for companion, what in filter(None, kept):
            if companion.is_dir():
                raise OutputError(f"{companion} is a folder, but batchgen keeps {what} for {path} there; "
                                  "remove or rename that folder")


def _prepare(job: Job, force_resume: bool) -> None:
    """Take the locks, check a resume against the records' config and dataset, read what the
    files answer, then prepare the files (nothing is changed before every check passed)."""
    config = job.config
    outputs = job.outputs
    try:
        for path in outputs:  # the error file too: a second job must not write into it either
            job.locks.append(OutputLock(path).acquire())
        for path in outputs:
            check_output(path, config.output.if_exists)
        previous = read_summary(config.output.summary_file)
        source = _local_source(config)
        job.dataset = source_digest(source)
        if config.output.if_exists == "resume":
            resuming = any(Path(p).is_file() and Path(p).stat().st_size > 0 for p in outputs)
            if resuming and not force_resume:
                _check_same_config(config, previous, job.resolved, job.dataset)
            written = (r for path in outputs if Path(path).exists() for r in read_records(path))
            job.answered = job.records.resume_index(written)  # reads past a torn tail, changes nothing
            job.previous = previous if len(job.answered) else None
        for path in outputs:
            prepare_output(path, config.output.if_exists, key=None)
        # Before the first record: the config these records are written with.
        write_json_atomic(sidecar_path(config.output.path), sidecar(job.resolved, job.dataset))
    except BaseException:
        job.release()
        raise


def _check_same_config(config: RunConfig, previous: dict[str, Any] | None, resolved: dict[str, Any],
                       dataset: dict[str, Any] | None) -> None:
    """Raise :class:`ResumeMismatchError` when the records were written with a config or a
    dataset that differs in a way that changes what a record holds, or when nothing (or only a
    damaged sidecar) says what it was."""
    where = str(sidecar_path(config.output.path))
    try:
        kept = read_sidecar(config.output.path)
    except SidecarError as exc:
        raise ResumeMismatchError(
            f"cannot resume {config.output.path}: {exc}, so nothing says which config its records were "
            "written with; pass --force-resume to append anyway (it writes a new one), or --overwrite to start over"
        ) from None
    before = kept["config"] if kept is not None else None
    if before is None and previous is not None and isinstance(previous.get("config"), dict):
        before, where = previous["config"], str(config.output.summary_file)  # written by an older batchgen
    if before is None:
        raise ResumeMismatchError(
            f"cannot resume {config.output.path}: nothing says which config its records were written with "
            f"({where} is missing); pass --force-resume to append anyway, or --overwrite to start over"
        )
    legacy = kept is None or kept.get("version") != SIDECAR_VERSION  # written by an older batchgen
    changes = config_differences(before, resolved, defaults=schema_defaults(RunConfig) if legacy else None)
    recorded = kept.get("dataset", "(not recorded)") if kept is not None else "(not recorded)"
    if legacy and (kept is None or "dataset" not in kept):
        recorded = dataset  # older versions kept no digest: nothing to compare the dataset with
    if recorded != dataset:
        edited = " (the file changed since these records were written)" if isinstance(recorded, dict) else ""
        changes.append(f"the dataset at data.source {config.data.source}: {_digest_text(recorded)} before, "
                       f"{_digest_text(dataset)} now{edited}")
    if changes:
        lines = "\n".join(f"  - {change}" for change in changes)
        raise ResumeMismatchError(
            f"cannot resume {config.output.path}: its records were written with a different config "
            f"(from {where}); resuming would mix records of both:\n{lines}\n"
            "restore those settings, pass --force-resume to append anyway, or --overwrite to start over"
        )


def _digest_text(digest: Any) -> str:
    """A :func:`~batchgen.run.fingerprint.source_digest` as the resume message shows it."""
    if isinstance(digest, dict):
        return f"{digest.get('bytes')} bytes, sha256 {str(digest.get('sha256'))[:12]}"
    return "not a local file" if digest is None else str(digest)
