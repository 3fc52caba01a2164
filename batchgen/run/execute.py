"""The run loop: a planned :class:`~batchgen.run.plan.Job` in, its records and summary out.

:func:`execute` starts the executor, streams the source's prompts to it as requests and writes
each result, through the job's record format, as soon as it is final (finish order, one record
per row). A prompt that cannot run is written as an error record at once and never reaches the
engine. Anything raised here is a runtime failure (exit status 1): the summary still says
``"failed"`` (or ``"interrupted"``), and every line already in the JSONL stays valid, so
``--resume`` picks up where it stopped. A run whose records are all written is ``"completed"``,
even when a signal arrived meanwhile (see :mod:`batchgen.run.signals`).

Lifecycle hooks fire only here, at the edges; the engine's step loop never calls a hook.
This module imports neither torch nor the engine at import time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchgen.plugins import PluginError
from batchgen.run.adapters import adapter_metrics
from batchgen.run.errors import RunFailed, TooManyErrors
from batchgen.run.executors import ExecutorError, make_executor
from batchgen.run.plan import Job
from batchgen.run.progress import Progress, announce
from batchgen.io.protocols import PromptRecord
from batchgen.run.signals import STOP
from batchgen.run.summary import Summary, signal_name, tally
from batchgen.io.output_file import JsonlWriter, OutputWriteError

__all__ = ["MIN_RECORDS_FOR_ERROR_RATE", "execute"]

#: ``--max-error-rate`` is checked once this many records of the run are written.
MIN_RECORDS_FOR_ERROR_RATE = 10


class _Hooks:
    """Fires lifecycle hooks and notes each failure in the summary's ``hook_errors``."""

    def __init__(self, job: Job, summary: dict[str, Any]) -> None:
        self.registry = job.registry
        self.summary = summary

    def __call__(self, hook: str, **kwargs: Any) -> None:
        try:
            self.registry.notify(hook, **kwargs)
        except PluginError as exc:
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
    ``model`` (see :mod:`batchgen.run.executors`) and stopped at the end. With
    ``max_error_rate``, the run stops (:class:`TooManyErrors`) once more than that share of its
    records are errors, checked from the :data:`MIN_RECORDS_FOR_ERROR_RATE`-th record on.

    Raises :class:`RunFailed` (or ``KeyboardInterrupt``) after writing a summary whose
    ``status`` says what happened. A ``batchgen_run_end`` hook that fails raises
    :class:`RunFailed` too, after the summary (status ``completed``) records it under
    ``hook_errors``. The output's lock is released in every case.
    """
    run = _Run(job, quiet, max_error_rate)
    owned = executor is None
    try:
        executor = executor or make_executor(job.config, llm)
        # A reused engine has counted earlier work; throughput covers this run only.
        before = executor.stats() or {}
        run.work(executor)
        run.settle()
        try:
            run.problem = run.summary.finish(executor, before, run.new_records, run.tallied)
        finally:
            if owned:
                executor.close()  # stops the replicas, on Ctrl-C too
        run.end()
    finally:
        job.release()
    return run.result()


class _Run:
    """One run's state, from its start to its summary: the records it wrote, how it ended
    (``outcome``: None, or what stopped it) and what the summary file could not record
    (``problem``)."""

    def __init__(self, job: Job, quiet: bool, max_error_rate: float | None) -> None:
        self.job, self.quiet, self.max_error_rate = job, quiet, max_error_rate
        self.summary = Summary(job)
        self.data = self.summary.data
        self.new_records = {"ok": 0, "error": 0}
        self.hooks = _Hooks(job, self.data)
        self.outcome: BaseException | None = None
        self.tallied: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.problem: str | None = None

    def work(self, executor: Any) -> None:
        """Start the run, load the model if rows are left and generate them; what stops it is
        kept as the ``outcome`` (its message in the summary's ``error``)."""
        try:
            self.summary.start()
            self.hooks("batchgen_run_start", config=self.job.resolved)
            with STOP.interruptible():
                self._load_model(executor)
                t_gen = time.perf_counter()
                if self.job.todo:
                    _generate(self.job, executor, self.quiet, self.new_records, self.hooks, self.max_error_rate)
                self.summary.timings["generate_s"] = time.perf_counter() - t_gen
        except KeyboardInterrupt as exc:
            self.outcome = exc
        except (RunFailed, ExecutorError, OutputWriteError, PluginError) as exc:
            self.data["error"] = str(exc)
            self.outcome = exc
        except Exception as exc:
            self.data["error"] = f"{type(exc).__name__}: {exc}"
            self.outcome = exc

    def _load_model(self, executor: Any) -> None:
        """Start the executor's engine, timed, unless nothing is left (a finished run resumed:
        skip the model) or it is loaded already."""
        if not self.job.todo or executor.tokenizer is not None:
            return
        t = time.perf_counter()
        announce(f"loading model {self.job.config.model.name}", self.quiet)
        executor.start()
        self.summary.timings["load_model_s"] = time.perf_counter() - t
        split = getattr(executor, "thread_split", None)
        if split:
            announce(split, self.quiet)

    def settle(self) -> None:
        """Tally the records (after a clean or an interrupted run) and set the summary's status."""
        if self.outcome is None or isinstance(self.outcome, KeyboardInterrupt):
            try:
                self.tallied = tally(self.job, with_metrics=True)
            except Exception as exc:
                if self.outcome is None:
                    self.data["error"] = f"{type(exc).__name__}: {exc}"
                    self.outcome = exc
            else:
                if self.outcome is not None and self.tallied[0]["total"] >= len(self.job.source):
                    self.outcome = None  # every record is written: the run is complete, whenever a signal landed
        if self.outcome is None:
            assert self.tallied is not None
            self.data["metrics"] = self.tallied[1]
            self.data.update(adapter_metrics(self.job))  # a LoRA sweep: each metric per adapter too
            self.data["status"] = "completed"
        elif isinstance(self.outcome, KeyboardInterrupt):
            self.data["status"] = "interrupted"
            self.data["signal"] = signal_name(getattr(self.outcome, "signum", None))
        else:
            self.data["status"] = "failed"

    def end(self) -> None:
        """Fire ``batchgen_run_end`` after a complete run whose summary is written."""
        if self.outcome is not None or self.problem is not None:
            return
        try:
            self.hooks("batchgen_run_end", summary=self.data)
        except PluginError as exc:
            # The records are complete; the summary says so and names the failed hook.
            self.problem = self.summary.write()
            raise RunFailed(
                f"{exc}; the run itself completed ({self.data['records']['total']} records in "
                f"{self.job.config.output.path})"
            ) from exc

    def result(self) -> dict[str, Any]:
        """The summary of a complete run; else raise what stopped it."""
        if isinstance(self.outcome, KeyboardInterrupt):
            raise self.outcome
        if self.outcome is not None:
            message = self.data["error"]
            if self.problem and self.problem != message:
                message += f"; also, the summary could not be written: {self.problem}"
            failure = TooManyErrors if isinstance(self.outcome, TooManyErrors) else RunFailed
            raise failure(message) from self.outcome
        if self.problem:
            raise RunFailed(
                f"{self.problem}; the {self.data['records']['total']} records in {self.job.config.output.path} "
                "are complete (rerun with --resume to write the summary)"
            )
        return self.data


def _generate(
    job: Job,
    executor: Any,
    quiet: bool,
    new_records: dict[str, int],
    hooks: _Hooks,
    max_error_rate: float | None,
) -> None:
    """Stream every remaining row through ``executor``, writing each record as it finishes."""
    config = job.config
    builder = job.records.builder(executor)
    prompts = job.source.prompts(executor, job.answered)
    # request id -> (its prompt, None) or, for one of a prompt's several requests, (its group, slot)
    pending: dict[Any, tuple[Any, int | None]] = {}
    error_path = config.output.error_path
    # Group commit: records finishing together (one engine step) share one fsync.
    with JsonlWriter(config.output.path, group_commit=True) as writer, (
        JsonlWriter(error_path, group_commit=True) if error_path else contextlib.nullcontext(writer)
    ) as errors, Progress(job.todo, mode="off" if quiet else None, scoring=job.scoring is not None) as progress:
        sink = _RecordSink(job, builder, writer, errors, progress, hooks, new_records, max_error_rate)
        for output in executor.stream(_requests(prompts, pending, sink.finish), on_tokens=progress.on_tokens):
            entry = pending.pop(output.request_id, None)
            if entry is None:
                raise RunFailed(f"the engine returned an unknown request id {output.request_id!r}")
            target, slot = entry
            if slot is None:
                sink.finish(target, output)
            elif target.arrived(slot, output):
                sink.finish(target.prompt, target.outputs)
    if pending:
        raise RunFailed(f"the engine finished without returning {len(pending)} request(s), e.g. {next(iter(pending))!r}")


def _requests(prompts: Iterator[PromptRecord], pending: dict[Any, tuple[Any, int | None]],
              finish: Callable[[PromptRecord, Any], None]) -> Iterator[Any]:
    """The engine requests of ``prompts``, each noted in ``pending``; a prompt that cannot run
    is finished (an error record) at once instead."""
    from batchgen.engine.outputs import Request  # deferred: this module imports no engine (see above)

    for prompt in prompts:
        if prompt.error is not None:
            finish(prompt, None)
            continue
        if prompt.requests is None:
            pending[prompt.id] = (prompt, None)
            yield Request(prompt.id, prompt.prompt_token_ids or prompt.prompt, prompt.params,
                          prompt.lora_request)
            continue
        group = _Group(prompt)
        for slot, request in enumerate(prompt.requests):
            if request.request_id in pending:
                raise RunFailed(f"two requests of the run have the id {request.request_id!r}")
            pending[request.request_id] = (group, slot)
            yield request


class _RecordSink:
    """Where finished rows go: each becomes a record in the output (or the error file), counted,
    shown in the progress and announced to the hooks; the error rate is checked after each."""

    def __init__(self, job: Job, builder: Any, writer: Any, errors: Any, progress: Progress, hooks: _Hooks,
                 new_records: dict[str, int], max_error_rate: float | None) -> None:
        self.job, self.builder, self.writer, self.errors, self.progress = job, builder, writer, errors, progress
        self.hooks, self.new_records, self.max_error_rate = hooks, new_records, max_error_rate
        self.last_failed: dict[str, Any] | None = None

    def finish(self, prompt: PromptRecord, output: Any | None) -> None:
        """Write the record of ``prompt`` (``output``: its engine output, None for an error)."""
        records = self.job.records
        record = self.builder.make(prompt, output)
        failed = records.failed(record)
        (self.errors if failed else self.writer).write(record)
        self.new_records["error" if failed else "ok"] += 1
        self.progress.record_finished(_progress_tokens(self.job, record), failed)
        self.hooks("batchgen_record_finished", record=record)
        if failed:
            self.last_failed = records.describe_error(record)
        if self.max_error_rate is not None:
            _check_error_rate(self.new_records, self.max_error_rate, records.example(self.last_failed or {}))
        STOP.check()  # a signal that landed where it could not raise stops the run here


def _progress_tokens(job: Job, record: dict[str, Any]) -> int:
    """What a finished record adds to the progress: its kept tokens, or a scoring job's scored ones."""
    if job.scoring is not None:
        return int((record.get("usage") or {}).get("prompt_tokens") or 0)
    return job.records.output_tokens(record)


class _Group:
    """The outputs of a prompt with several requests, collected until the last one arrives."""

    def __init__(self, prompt: PromptRecord) -> None:
        self.prompt = prompt
        self.outputs: list[Any] = [None] * len(prompt.requests or ())
        self.left = len(self.outputs)

    def arrived(self, slot: int, output: Any) -> bool:
        """Keep ``output`` in ``slot``; True once every request's output is in."""
        self.outputs[slot] = output
        self.left -= 1
        return self.left == 0


def _check_error_rate(new_records: dict[str, int], limit: float, last_failed: str) -> None:
    """Raise :class:`TooManyErrors` past ``limit``; ``last_failed`` names the last error record."""
    written = new_records["ok"] + new_records["error"]
    if written < MIN_RECORDS_FOR_ERROR_RATE:
        return
    rate = new_records["error"] / written
    if rate > limit:
        raise TooManyErrors(
            f"{new_records['error']} of the {written} records written so far are errors ({rate:.0%}), "
            f"over --max-error-rate {limit:g}; the last one, {last_failed}"
        )
