"""One run: config -> dataset -> engine -> metrics -> JSONL records + run summary.

The run is split in two so the CLI can tell the user's mistakes from runtime failures:

* :func:`plan` does every check that needs no model (plugins built with their options, the
  dataset loaded, its columns checked, the output prepared) and raises :class:`SetupError`
  subclasses (:class:`~batchgen.config.ConfigError`, :class:`~batchgen.run.dataset.DataError`,
  :class:`~batchgen.run.writer.OutputError`, :class:`~batchgen.plugins.PluginError`) for problems
  the user must fix: exit status 2.
* :func:`execute` loads the model and generates; anything it raises is a runtime failure
  (exit status 1). It still writes a summary with ``"status": "failed"`` (or
  ``"interrupted"``), and every line already in the JSONL stays valid, so ``--resume`` picks up
  where it stopped.

:func:`plan` takes the output's lock (:class:`~batchgen.run.writer.OutputLock`) before it touches the
file, and :func:`execute` holds it until the summary is written: one run per output at a time.
A resume first compares the config's fingerprint (:mod:`batchgen.run.fingerprint`) with the earlier
run's summary and refuses a different one unless forced. The summary is written when the run
starts (``"status": "running"``) and again when it ends; its counts are read back from the file,
so they are exact whenever the run stopped.

Records are written in finish order, one per dataset row, each as soon as it is final; rows whose
prompt cannot be built are written as error records straight away and never reach the engine.
With ``data.format: openai_batch`` the rows are the lines of an OpenAI batch file, each with its
own generation parameters, and with ``output.format: openai_batch`` the records are OpenAI
response lines; both live in :mod:`batchgen.openai_batch`.
Lifecycle hooks fire only here, at the edges; the engine's step loop never calls a hook.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, GenerationSection, MetricRef, RunConfig, resolved_dict
from batchgen.run.dataset import DataError, LoadedData, PromptBuilder, PromptRecord, check_columns, iter_prompts, load_rows
from batchgen.run.fingerprint import config_differences, fingerprint_hash
from batchgen.run.writer import (
    JsonlWriter,
    OutputError,
    OutputLock,
    OutputWriteError,
    check_writable,
    prepare_output,
    read_records,
    read_summary,
    write_json_atomic,
)
from batchgen.run.progress import Progress, announce

__all__ = [
    "Interrupted",
    "Job",
    "ResumeMismatchError",
    "RunFailed",
    "SETUP_ERRORS",
    "TooManyErrors",
    "build_params",
    "execute",
    "plan",
    "run",
]

#: ``--max-error-rate`` is checked once this many records of the run are written.
MIN_RECORDS_FOR_ERROR_RATE = 10


class RunFailed(Exception):
    """The run started but could not finish (exit status 1)."""


class TooManyErrors(RunFailed):
    """The share of error records went over ``max_error_rate`` (exit status 3)."""


class Interrupted(KeyboardInterrupt):
    """A signal asked the run to stop (SIGINT or SIGTERM); the CLI exits with 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ResumeMismatchError(OutputError):
    """``--resume`` on records written with a different generation config (exit status 2)."""


def _plugin_error_type() -> type[Exception]:
    from batchgen.plugins import PluginError

    return PluginError


#: Exceptions that mean "fix your config or inputs" (exit status 2).
SETUP_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, OutputError, _plugin_error_type())


@dataclass
class Job:
    """Everything :func:`execute` needs, checked and ready (see :func:`plan`)."""

    config: RunConfig
    registry: Any
    data: LoadedData
    metrics: list[tuple[MetricRef, Any]]
    logits_processors: list[Any]
    done_ids: Any = field(default_factory=set)  # a set of ids, or an openai_batch.ResumeIndex
    config_path: str | None = None
    #: The locks of the output files (the output, and the error file if any), held from
    #: :func:`plan` to the end of :func:`execute`.
    locks: list[OutputLock] = field(default_factory=list)
    #: The summary of the run this one resumes (None for a fresh run).
    previous: dict[str, Any] | None = None

    def release(self) -> None:
        """Release the outputs' locks (idempotent; :func:`execute` does it when it ends)."""
        for lock in self.locks:
            lock.release()

    @property
    def todo(self) -> int:
        """Rows this run still has to write."""
        if hasattr(self.data, "todo"):  # a streamed OpenAI batch file
            return self.data.todo(self.done_ids)
        return sum(1 for i in self.data.ids if i not in self.done_ids)


def build_params(gen: GenerationSection, logits_processors: Sequence[Any] = ()) -> Any:
    """The engine parameters for one record: SamplingParams (greedy, sample) or BeamSearchParams."""
    from batchgen.sampling.params import BeamSearchParams, SamplingParams

    common: dict[str, Any] = dict(
        max_tokens=gen.max_tokens,
        min_tokens=gen.min_tokens,
        stop=list(gen.stop),
        stop_token_ids=list(gen.stop_token_ids),
        ignore_eos=gen.ignore_eos,
        structured_outputs=None if gen.structured_outputs is None else gen.structured_outputs.params(),
    )
    if gen.mode == "beam":
        return BeamSearchParams(
            beam_width=gen.beam_width,
            length_penalty=gen.length_penalty,
            early_stopping=gen.early_stopping,
            **common,
        )
    sampling: dict[str, Any] = dict(
        presence_penalty=gen.presence_penalty,
        frequency_penalty=gen.frequency_penalty,
        repetition_penalty=gen.repetition_penalty,
        logprobs=gen.logprobs,
        logits_processors=list(logits_processors),
    )
    if gen.mode == "greedy":
        return SamplingParams(n=1, temperature=0.0, **sampling, **common)
    return SamplingParams(
        n=gen.n,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        min_p=gen.min_p,
        **sampling,
        **common,
    )


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
            raise _plugin_error_type()(
                f"metric '{ref.name}' ({label}) could not be configured: {type(exc).__name__}: {exc}",
                plugin=getattr(metric, "plugin", None),
            ) from exc
    if issues:
        raise ConfigError(issues)


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
    (overwrite) or repaired (resume) per ``config.output.if_exists``, and the ids already in it
    are skipped. A resume whose fingerprinted config differs from the earlier run's summary
    raises :class:`ResumeMismatchError` unless ``force_resume``.

    Raises:
        one of :data:`SETUP_ERRORS`.
    """
    if registry is None:
        from batchgen.plugins import load_registry

        registry = load_registry(config.plugins)
    metrics = [(ref, registry.build_metric(ref.name, ref.options)) for ref in config.metrics]
    _configure_metrics(config, registry, metrics)
    processors = []
    if config.generation.sampler is not None:
        sampler = config.generation.sampler
        processors.append(registry.build_sampler(sampler.name, sampler.options))
    try:
        build_params(config.generation, processors)
    except ValueError as exc:  # the schema mirrors the engine's checks; this is a backstop
        raise ConfigError([ConfigIssue("generation", str(exc))]) from None
    from batchgen.models import ModelNotFoundError, check_model

    try:
        # Cheap for folders and cached hub ids; converts the embedded GGUF the first time only.
        check_model(config.model.name)
    except ModelNotFoundError as exc:
        raise ConfigError([ConfigIssue("model.name", str(exc))]) from None
    from batchgen.run.executors.ray import check_executor

    check_executor(config)  # backend 'ray' without Ray installed: say what to install
    required = {ref.key: tuple(getattr(metric, "required_columns", ()) or ()) for ref, metric in metrics}
    if config.data.format == "openai_batch":
        from batchgen.openai_batch import open_input

        data: Any = open_input(config, required)
    else:
        data = load_rows(config.data)
        check_columns(data.columns, config, required)
    outputs = _output_paths(config)
    for path in (*outputs, config.output.summary_file):
        check_writable(path)
    job = Job(config, registry, data, metrics, processors, set(), config_path)
    if not prepare:
        return job
    try:
        for path in outputs:  # the error file too: a second job must not write into it either
            job.locks.append(OutputLock(path).acquire())
        previous = read_summary(config.output.summary_file)
        resuming = config.output.if_exists == "resume" and any(
            Path(p).is_file() and Path(p).stat().st_size > 0 for p in outputs
        )
        if resuming and not force_resume and previous is not None:
            _check_same_config(config, previous, resolved_dict(config, registry))
        job.done_ids = _prepare_outputs(config, outputs)
        job.previous = previous if job.done_ids else None
    except BaseException:
        job.release()
        raise
    return job


def _output_paths(config: RunConfig) -> list[str]:
    """The record files of a run: ``output.path``, then ``output.error_path`` when set."""
    return [p for p in (config.output.path, config.output.error_path) if p]


def _check_same_config(config: RunConfig, previous: dict[str, Any], resolved: dict[str, Any]) -> None:
    """Raise :class:`ResumeMismatchError` when the earlier run's config differs in a way that
    changes what a record holds."""
    before = previous.get("config")
    if not isinstance(before, dict):
        return
    changes = config_differences(before, resolved)
    if changes:
        lines = "\n".join(f"  - {change}" for change in changes)
        raise ResumeMismatchError(
            f"cannot resume {config.output.path}: its records were written with a different config "
            f"(from {config.output.summary_file}); resuming would mix records of both:\n{lines}\n"
            "restore those settings, pass --force-resume to append anyway, or --overwrite to start over"
        )


def _prepare_outputs(config: RunConfig, paths: Sequence[str]) -> Any:
    """Create, truncate or repair the output file(s); return what they already answer."""
    if config.data.format == "openai_batch":
        from batchgen.openai_batch import resume_index

        for path in paths:
            prepare_output(path, config.output.if_exists, key=None)
        return resume_index(config)
    key = "custom_id" if config.output.format == "openai_batch" else "id"
    return set().union(*(prepare_output(path, config.output.if_exists, key=key) for path in paths))


class _BatchgenRecords:
    """``output.format: jsonl``: batchgen's own records (see :func:`make_record`).

    A record kind makes records (``make``) and reads them back (the static methods), which is
    all the summary's counts, ``--max-error-rate`` and resume need to know of a format; the
    other kind is :class:`batchgen.openai_batch.ResponseBuilder`.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def make(self, prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
        return make_record(prompt, output, self.config)

    @staticmethod
    def failed(record: dict[str, Any]) -> bool:
        """True for an error record."""
        return record.get("error") is not None

    @staticmethod
    def key(record: dict[str, Any]) -> str | None:
        """The row id a record answers (None for a row that had none)."""
        value = record.get("id")
        return None if value is None else str(value)

    @staticmethod
    def output_tokens(record: dict[str, Any]) -> int:
        """The tokens a record keeps (``usage.generated_tokens``)."""
        return int((record.get("usage") or {}).get("generated_tokens") or 0)

    @staticmethod
    def describe_error(record: dict[str, Any]) -> dict[str, Any]:
        """``{"id", "error"}`` of a record, for the summary's ``first_error`` and messages."""
        return {"id": record.get("id"), "error": record.get("error")}


def error_example(example: dict[str, Any]) -> str:
    """``id 'q00': <error>`` (``custom_id 'x': ...`` for OpenAI lines) of a ``describe_error``."""
    name = "custom_id" if "custom_id" in example else "id"
    return f"{name} {example.get(name)!r}: {example.get('error')}"


def _records(config: RunConfig, llm: Any = None, builder: PromptBuilder | None = None) -> Any:
    """The record kind of ``config.output.format`` (``make`` needs ``llm``; reading back does not)."""
    if config.output.format != "openai_batch":
        return _BatchgenRecords(config)
    from batchgen.openai_batch import ResponseBuilder

    if llm is None:
        return ResponseBuilder
    return ResponseBuilder(config.model.name, llm.tokenizer, chat=builder is not None and builder.use_chat,
                           top_logprobs=config.generation.logprobs)


# --------------------------------------------------------------------------- records


def _generation(completion: Any, beam: bool, with_logprobs: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "index": completion.index,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "cumulative_logprob": completion.cumulative_logprob,
        "num_tokens": len(completion.token_ids),
    }
    if beam:
        entry["score"] = completion.score
    if with_logprobs:
        entry["logprobs"] = completion.logprobs
    return entry


def make_record(prompt: PromptRecord, output: Any | None, config: RunConfig) -> dict[str, Any]:
    """The JSONL record of one row (see docs/config.md, "Output records").

    ``output`` is the engine's RequestOutput, or None for a row that never reached the engine.
    """
    usage = {
        "prompt_tokens": len(prompt.prompt_token_ids or ()),
        "generated_tokens": 0,
        "cached_tokens": 0,
    }
    generations: list[dict[str, Any]] = []
    error = prompt.error
    if output is not None:
        stats = output.stats
        usage = {
            "prompt_tokens": stats.num_prompt_tokens or len(output.prompt_token_ids or ()),
            "generated_tokens": stats.num_generated_tokens,
            "cached_tokens": stats.num_cached_tokens,
        }
        error = output.error
        from batchgen.sampling.params import BeamSearchParams

        params = prompt.params  # the row's own, else the job's
        beam = config.generation.mode == "beam" if params is None else isinstance(params, BeamSearchParams)
        logprobs = config.generation.logprobs if params is None else getattr(params, "logprobs", None)
        with_logprobs = logprobs is not None
        if beam:
            # Best beam first, indexed by rank, so that "the first generation" means the same
            # thing (the model's best answer) in every mode.
            ranked = sorted(output.outputs, key=lambda c: -c.score if c.score is not None else float("inf"))
            generations = [_generation(c, True, False) | {"index": rank} for rank, c in enumerate(ranked)]
        else:
            completions = sorted(output.outputs, key=lambda c: c.index)
            generations = [_generation(c, False, with_logprobs) for c in completions]
    return {
        "id": prompt.id,
        "index": prompt.index,
        "prompt": prompt.prompt,
        "generations": generations,
        "metrics": {},
        "error": error,
        "usage": usage,
    }


def _score(job: Job, record: dict[str, Any], row: dict[str, Any]) -> None:
    """Fill ``record["metrics"]``; a failing metric sets the record's error, keeping generations."""
    if record["error"] is not None:
        return
    plugin_error = _plugin_error_type()
    for ref, metric in job.metrics:
        try:
            record["metrics"][ref.key] = metric.score(record, row)
        except plugin_error as exc:
            record["error"] = str(exc)
            return


# --------------------------------------------------------------------------- run


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("batchgen", "torch", "transformers", "datasets", "pydantic", "pluggy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _tally(job: Job, with_metrics: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Count the records of the whole file (resumed ones included) and, if asked, aggregate
    every metric over the ok ones. Returns ``(records, metrics)``.

    Counting the file, rather than what this process believes it wrote, keeps the counts exact
    when a signal lands between a write and its bookkeeping.
    """
    counts: dict[str, Any] = {"total": 0, "ok": 0, "error": 0, "this_run": 0, "this_run_ok": 0, "this_run_error": 0}
    output_tokens = 0
    first_error = None
    per_metric: dict[str, list[dict[str, Any]]] = {ref.key: [] for ref, _ in job.metrics}
    kind = _records(job.config)
    keyless_done = getattr(job.done_ids, "keyless", 0)  # answered in input order: the first ones are old
    for record in (r for path in _output_paths(job.config) if Path(path).exists() for r in read_records(path)):
        failed = kind.failed(record)
        key = kind.key(record)
        if key is None:
            new, keyless_done = keyless_done <= 0, keyless_done - 1
        else:
            new = key not in job.done_ids
        counts["total"] += 1
        counts["error" if failed else "ok"] += 1
        if new:
            counts["this_run"] += 1
            counts["this_run_error" if failed else "this_run_ok"] += 1
            output_tokens += kind.output_tokens(record)
        if failed:
            if first_error is None:
                first_error = kind.describe_error(record)
            continue
        for key, scores in per_metric.items():
            value = (record.get("metrics") or {}).get(key)
            if isinstance(value, dict):
                scores.append(value)
    counts["output_tokens"] = output_tokens
    if first_error is not None:
        counts["first_error"] = first_error
    metrics = {ref.key: metric.aggregate(per_metric[ref.key]) for ref, metric in job.metrics} if with_metrics else {}
    return counts, metrics


def _run_entry(summary: dict[str, Any]) -> dict[str, Any]:
    """One invocation's line in the summary's ``runs`` history."""
    records = summary.get("records") or {}
    return {
        "started_at": summary.get("started_at"),
        "finished_at": summary.get("finished_at"),
        "status": summary.get("status"),
        "records": {k: records.get(k) for k in ("this_run", "this_run_ok", "this_run_error")},
        "timings": summary.get("timings"),
        "throughput": summary.get("throughput"),
    }


def _history(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ``runs`` of the summary this run resumes (a summary without one counts as one run)."""
    if not previous:
        return []
    runs = previous.get("runs")
    if isinstance(runs, list):
        return [r for r in runs if isinstance(r, dict)]
    return [_run_entry(previous)]


class _Hooks:
    """Fires lifecycle hooks and notes each failure in the summary's ``hook_errors``."""

    def __init__(self, job: Job, summary: dict[str, Any]) -> None:
        self.registry = job.registry
        self.summary = summary

    def __call__(self, hook: str, **kwargs: Any) -> None:
        try:
            self.registry.notify(hook, **kwargs)
        except _plugin_error_type() as exc:
            self.summary.setdefault("hook_errors", []).append(str(exc))
            raise


def execute(
    job: Job,
    *,
    quiet: bool = False,
    llm: Any = None,
    executor: Any = None,
    max_error_rate: float | None = None,
) -> dict[str, Any]:
    """Generate every remaining row, write records and the summary; return the summary.

    ``llm`` may be passed to reuse a loaded engine, or ``executor`` a started executor (left
    running); otherwise the executor that ``executor:`` asks for is built from ``engine`` and
    ``model`` (see :mod:`batchgen.run.executors.ray`) and stopped at the end. With ``max_error_rate``, the run stops (:class:`TooManyErrors`) once more than
    that share of its records are errors, checked from the
    :data:`MIN_RECORDS_FOR_ERROR_RATE`-th record on.

    Raises :class:`RunFailed` (or ``KeyboardInterrupt``) after writing a summary whose
    ``status`` says what happened. A ``batchgen_run_end`` hook that fails raises
    :class:`RunFailed` too, after the summary (status ``completed``) records it under
    ``hook_errors``. The output's lock is released in every case.
    """
    config = job.config
    started, t0 = _now(), time.perf_counter()
    resolved = resolved_dict(config, job.registry)
    summary: dict[str, Any] = {
        "status": "running",
        "output": str(config.output.path),
        "config_file": job.config_path,
        "config": resolved,
        "fingerprint": fingerprint_hash(resolved),
        "versions": _versions(),
        "started_at": started,
    }
    history = _history(job.previous)
    timings: dict[str, float] = {}
    new_records = {"ok": 0, "error": 0}
    hooks = _Hooks(job, summary)
    from batchgen.run.executors.ray import ExecutorError, make_executor

    owned = executor is None
    executor = executor or make_executor(config, llm)
    # A reused engine has counted earlier work; throughput covers this run only.
    before = executor.stats() or {}
    outcome: BaseException | None = None
    tallied: tuple[dict[str, Any], dict[str, Any]] | None = None
    try:
        # Written now, so that a run killed by SIGKILL leaves its config (for a resume's check)
        # and its own entry in ``runs`` behind.
        write_json_atomic(config.output.summary_file, summary | {"runs": [*history, _run_entry(summary)]})
        hooks("batchgen_run_start", config=resolved)
        if job.todo and executor.tokenizer is None:  # nothing left (a finished run resumed): skip the model
            t = time.perf_counter()
            announce(f"loading model {config.model.name}", quiet)
            executor.start()
            timings["load_model_s"] = time.perf_counter() - t
        t_gen = time.perf_counter()
        if job.todo:
            _generate(job, executor, quiet, new_records, hooks, max_error_rate)
        timings["generate_s"] = time.perf_counter() - t_gen
        tallied = _tally(job, with_metrics=True)
        summary["metrics"] = tallied[1]
        summary["status"] = "completed"
    except KeyboardInterrupt as exc:
        summary["status"] = "interrupted"
        summary["signal"] = _signal_name(getattr(exc, "signum", None))
        outcome = exc
    except (RunFailed, ExecutorError, OutputWriteError, _plugin_error_type()) as exc:
        summary["status"] = "failed"
        summary["error"] = str(exc)
        outcome = exc
    except Exception as exc:
        summary["status"] = "failed"
        summary["error"] = f"{type(exc).__name__}: {exc}"
        outcome = exc
    try:
        try:
            summary_problem = _finish_summary(job, summary, timings, t0, executor, before, new_records, history, tallied)
        finally:
            if owned:
                executor.close()  # stops the replicas, on Ctrl-C too
        if outcome is None and summary_problem is None:
            try:
                hooks("batchgen_run_end", summary=summary)
            except _plugin_error_type() as exc:
                # The records are complete; the summary says so and names the failed hook.
                summary_problem = _write_summary(config, summary)
                raise RunFailed(
                    f"{exc}; the run itself completed ({summary['records']['total']} records in "
                    f"{config.output.path})"
                ) from exc
    finally:
        job.release()
    if isinstance(outcome, KeyboardInterrupt):
        raise outcome
    if outcome is not None:
        message = summary["error"]
        if summary_problem and summary_problem != message:
            message += f"; also, the summary could not be written: {summary_problem}"
        failure = TooManyErrors if isinstance(outcome, TooManyErrors) else RunFailed
        raise failure(message) from outcome
    if summary_problem:
        raise RunFailed(
            f"{summary_problem}; the {summary['records']['total']} records in {config.output.path} "
            "are complete (rerun with --resume to write the summary)"
        )
    return summary


def _signal_name(signum: int | None) -> str:
    import signal

    try:
        return signal.Signals(signum if signum is not None else signal.SIGINT).name
    except ValueError:
        return str(signum)


def _finish_summary(
    job: Job,
    summary: dict[str, Any],
    timings: dict[str, float],
    t0: float,
    executor: Any,
    before: dict[str, Any],
    new_records: dict[str, int],
    history: list[dict[str, Any]],
    tallied: tuple[dict[str, Any], dict[str, Any]] | None,
) -> str | None:
    """Fill in counts, timings, throughput and history, and write the summary.

    ``tallied`` is the completed run's :func:`_tally`; a run that stopped early is counted here.
    Returns None, or why the summary could not be written.
    """
    config = job.config
    try:
        counts = dict(tallied[0]) if tallied is not None else _tally(job, with_metrics=False)[0]
    except (OutputError, OSError) as exc:
        # The file cannot be read back (it is damaged or gone): fall back on this run's counts.
        counts = {"total": len(job.done_ids) + sum(new_records.values()), "this_run": sum(new_records.values()),
                  "this_run_ok": new_records["ok"], "this_run_error": new_records["error"], "output_tokens": 0}
        summary.setdefault("error", f"could not read back {config.output.path}: {exc}")
    summary["finished_at"] = _now()
    timings["total_s"] = time.perf_counter() - t0
    output_tokens = counts.pop("output_tokens", 0)
    summary["records"] = {
        **counts,
        "dataset_rows": len(job.data),
        "resumed": len(job.done_ids),
    }
    if config.output.format == "openai_batch":  # as OpenAI's Batch object counts them
        failed = counts.get("error", counts.get("this_run_error", 0))
        summary["request_counts"] = {"total": counts["total"], "completed": counts["total"] - failed, "failed": failed}
    stats = executor.stats()
    summary["executor"] = executor.describe()
    throughput = _throughput(stats, before, timings, counts.get("this_run", 0), output_tokens)
    previous = job.previous or {}
    if counts.get("this_run", 0) == 0 and previous.get("throughput"):
        # Nothing was generated (a finished run resumed): keep the figures of the run that did
        # the work; this run's own are in ``runs``.
        summary["timings"] = previous.get("timings")
        summary["throughput"] = previous.get("throughput")
        summary["engine"] = previous.get("engine")
    else:
        summary["timings"] = timings
        summary["throughput"] = throughput
        summary["engine"] = stats
    this_run = _run_entry(summary) | {"timings": timings, "throughput": throughput}
    summary["runs"] = [*history, this_run]
    return _write_summary(config, summary)


def _write_summary(config: RunConfig, summary: dict[str, Any]) -> str | None:
    try:
        write_json_atomic(config.output.summary_file, summary)
    except OutputWriteError as exc:
        return str(exc)
    return None


def _generate(
    job: Job,
    llm: Any,
    quiet: bool,
    new_records: dict[str, int],
    hooks: _Hooks,
    max_error_rate: float | None,
) -> None:
    """Stream every remaining row through ``llm`` (an executor), writing each record as it finishes."""
    config = job.config
    builder = PromptBuilder(config.prompt, llm.tokenizer, llm.max_model_len, config.generation.max_tokens)
    params = build_params(config.generation, job.logits_processors)
    records = _records(config, llm, builder)
    prompts: Iterator[PromptRecord]
    if config.data.format == "openai_batch":
        from batchgen.openai_batch import LineParser

        names = [config.model.name, *config.model.aliases]
        parser = LineParser(llm.tokenizer, llm.max_model_len, names, job.logits_processors)
        prompts = job.data.prompts(parser, job.done_ids)
    else:
        prompts = iter_prompts(job.data, builder, job.done_ids)
    pending: dict[str, PromptRecord] = {}
    error_path = config.output.error_path
    # Group commit: records finishing together (one engine step) share one fsync.
    with JsonlWriter(config.output.path, group_commit=True) as writer, (
        JsonlWriter(error_path, group_commit=True) if error_path else contextlib.nullcontext(writer)
    ) as errors, Progress(job.todo, mode="off" if quiet else None) as progress:

        def finish(prompt: PromptRecord, output: Any | None) -> None:
            record = records.make(prompt, output)
            if job.metrics:
                _score(job, record, prompt.row)
            failed = records.failed(record)
            (errors if failed else writer).write(record)
            new_records["error" if failed else "ok"] += 1
            progress.record_finished(records.output_tokens(record), failed)
            hooks("batchgen_record_finished", record=record)
            if max_error_rate is not None:
                _check_error_rate(new_records, max_error_rate, records.describe_error(record))

        def requests() -> Iterator[Any]:
            from batchgen.engine.llm import Request

            for prompt in prompts:
                if prompt.error is not None:
                    finish(prompt, None)
                    continue
                pending[prompt.id] = prompt
                yield Request(prompt.id, prompt.prompt_token_ids or prompt.prompt, prompt.params or params)

        for output in llm.stream(requests(), on_tokens=progress.on_tokens):
            prompt = pending.pop(output.request_id, None)
            if prompt is None:
                raise RunFailed(f"the engine returned an unknown request id {output.request_id!r}")
            finish(prompt, output)
    if pending:
        raise RunFailed(f"the engine finished without returning {len(pending)} request(s), e.g. {next(iter(pending))!r}")


def _check_error_rate(new_records: dict[str, int], limit: float, record: dict[str, Any]) -> None:
    """Raise :class:`TooManyErrors` past ``limit``; ``record`` is the last one's ``describe_error``."""
    written = new_records["ok"] + new_records["error"]
    if written < MIN_RECORDS_FOR_ERROR_RATE:
        return
    rate = new_records["error"] / written
    if rate > limit:
        raise TooManyErrors(
            f"{new_records['error']} of the {written} records written so far are errors ({rate:.0%}), "
            f"over --max-error-rate {limit:g}; the last one, {error_example(record)}"
        )


def _throughput(
    stats: dict[str, Any] | None,
    before: dict[str, Any],
    timings: dict[str, float],
    records: int,
    output_tokens: int = 0,
) -> dict[str, float | int]:
    """Tokens and records per second of generation wall time (model loading excluded).

    ``before`` holds the engine's counters at the start of the run (empty for a new engine).
    ``generated_tokens`` is the engine's count: every token it sampled, for beam search every
    live beam's token at every step (pruned beams included), and the EOS that ends a sequence.
    ``output_tokens`` is what the records keep: the sum of their ``usage.generated_tokens``.
    """
    seconds = timings.get("generate_s") or max(timings.get("total_s", 0.0) - timings.get("load_model_s", 0.0), 0.0)

    def counted(key: str) -> int:
        return int((stats or {}).get(key, 0)) - int(before.get(key, 0))

    prompt_tokens = counted("num_prompt_tokens")
    generated = counted("num_generated_tokens")
    prefill = counted("num_prefill_tokens")  # computed: prefix-cache hits are not
    rate = (lambda n: n / seconds if seconds > 0 else 0.0)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill,
        "generated_tokens": generated,
        "output_tokens": output_tokens,
        "prompt_tokens_per_s": rate(prompt_tokens),
        "prefill_tokens_per_s": rate(prefill),
        "generated_tokens_per_s": rate(generated),
        "output_tokens_per_s": rate(output_tokens),
        "records_per_s": rate(records),
    }


def run(config: RunConfig, registry: Any = None, *, quiet: bool = False, config_path: str | None = None) -> dict[str, Any]:
    """:func:`plan` then :func:`execute`; the library entry point behind ``batchgen run``."""
    return execute(plan(config, registry, config_path=config_path), quiet=quiet)


def summary_path(config: RunConfig) -> Path:
    """Where the run summary of ``config`` is written."""
    return config.output.summary_file

