"""One run: config -> dataset -> engine -> metrics -> JSONL records + run summary.

The run is split in two so the CLI can tell the user's mistakes from runtime failures:

* :func:`plan` does every check that needs no model (plugins built with their options, the
  dataset loaded, its columns checked, the output prepared) and raises :class:`SetupError`
  subclasses (:class:`~batchgen.config.ConfigError`, :class:`~batchgen.dataset.DataError`,
  :class:`~batchgen.output.OutputError`, :class:`~batchgen.plugins.PluginError`) for problems
  the user must fix: exit status 2.
* :func:`execute` loads the model and generates; anything it raises is a runtime failure
  (exit status 1). It still writes a summary with ``"status": "failed"`` (or
  ``"interrupted"``), and every line already in the JSONL stays valid, so ``--resume`` picks up
  where it stopped.

:func:`plan` takes the output's lock (:class:`~batchgen.output.OutputLock`) before it touches the
file, and :func:`execute` holds it until the summary is written: one run per output at a time.
A resume first compares the config's fingerprint (:mod:`batchgen.fingerprint`) with the earlier
run's summary and refuses a different one unless forced. The summary is written when the run
starts (``"status": "running"``) and again when it ends; its counts are read back from the file,
so they are exact whenever the run stopped.

Records are written in finish order, one per dataset row, each as soon as it is final; rows whose
prompt cannot be built are written as error records straight away and never reach the engine.
Lifecycle hooks fire only here, at the edges; the engine's step loop never calls a hook.
"""

from __future__ import annotations

import datetime as _dt
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, GenerationSection, MetricRef, RunConfig, resolved_dict
from batchgen.dataset import DataError, LoadedData, PromptBuilder, PromptRecord, check_columns, iter_prompts, load_rows
from batchgen.fingerprint import config_differences, fingerprint_hash
from batchgen.output import (
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
from batchgen.progress import Progress, announce

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
    done_ids: set[str] = field(default_factory=set)
    config_path: str | None = None
    #: The output's lock, held from :func:`plan` to the end of :func:`execute`.
    lock: OutputLock | None = None
    #: The summary of the run this one resumes (None for a fresh run).
    previous: dict[str, Any] | None = None

    def release(self) -> None:
        """Release the output's lock (idempotent; :func:`execute` does it when it ends)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def todo(self) -> int:
        """Rows this run still has to write."""
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
    from batchgen.executor import check_executor

    check_executor(config)  # backend 'ray' without Ray installed: say what to install
    data = load_rows(config.data)
    required = {ref.key: tuple(getattr(metric, "required_columns", ()) or ()) for ref, metric in metrics}
    check_columns(data.columns, config, required)
    check_writable(config.output.path)
    check_writable(config.output.summary_file)
    job = Job(config, registry, data, metrics, processors, set(), config_path)
    if not prepare:
        return job
    job.lock = OutputLock(config.output.path).acquire()
    try:
        previous = read_summary(config.output.summary_file)
        output = Path(config.output.path)
        resuming = config.output.if_exists == "resume" and output.is_file() and output.stat().st_size > 0
        if resuming and not force_resume and previous is not None:
            _check_same_config(config, previous, resolved_dict(config, registry))
        job.done_ids = prepare_output(config.output.path, config.output.if_exists)
        job.previous = previous if job.done_ids else None
    except BaseException:
        job.release()
        raise
    return job


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
        beam = config.generation.mode == "beam"
        with_logprobs = config.generation.logprobs is not None
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
    for record in read_records(job.config.output.path):
        failed = record.get("error") is not None
        new = str(record.get("id")) not in job.done_ids
        counts["total"] += 1
        counts["error" if failed else "ok"] += 1
        if new:
            counts["this_run"] += 1
            counts["this_run_error" if failed else "this_run_ok"] += 1
            output_tokens += int((record.get("usage") or {}).get("generated_tokens") or 0)
        if failed:
            if first_error is None:
                first_error = {"id": record.get("id"), "error": record.get("error")}
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
    ``model`` (see :mod:`batchgen.executor`) and stopped at the end. With ``max_error_rate``, the run stops (:class:`TooManyErrors`) once more than
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
    from batchgen.executor import ExecutorError, make_executor

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
    pending: dict[str, PromptRecord] = {}
    with JsonlWriter(config.output.path) as writer, Progress(job.todo, mode="off" if quiet else None) as progress:

        def finish(prompt: PromptRecord, output: Any | None) -> None:
            record = make_record(prompt, output, config)
            _score(job, record, prompt.row)
            writer.write(record)
            failed = record["error"] is not None
            new_records["error" if failed else "ok"] += 1
            progress.record_finished(record["usage"]["generated_tokens"], failed)
            hooks("batchgen_record_finished", record=record)
            if max_error_rate is not None:
                _check_error_rate(new_records, max_error_rate, record)

        def requests() -> Iterator[Any]:
            from batchgen.engine.llm import Request

            for prompt in iter_prompts(job.data, builder, job.done_ids):
                if prompt.error is not None:
                    finish(prompt, None)
                    continue
                pending[prompt.id] = prompt
                yield Request(prompt.id, prompt.prompt_token_ids or prompt.prompt, params)

        for output in llm.stream(requests(), on_tokens=progress.on_tokens):
            prompt = pending.pop(output.request_id, None)
            if prompt is None:
                raise RunFailed(f"the engine returned an unknown request id {output.request_id!r}")
            finish(prompt, output)
    if pending:
        raise RunFailed(f"the engine finished without returning {len(pending)} request(s), e.g. {next(iter(pending))!r}")


def _check_error_rate(new_records: dict[str, int], limit: float, record: dict[str, Any]) -> None:
    written = new_records["ok"] + new_records["error"]
    if written < MIN_RECORDS_FOR_ERROR_RATE:
        return
    rate = new_records["error"] / written
    if rate > limit:
        raise TooManyErrors(
            f"{new_records['error']} of the {written} records written so far are errors ({rate:.0%}), "
            f"over --max-error-rate {limit:g}; the last one, id {record['id']!r}: {record['error']}"
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

