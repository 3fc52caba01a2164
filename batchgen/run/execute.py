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
from collections.abc import Iterator
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
    config = job.config
    run = Summary(job)
    summary = run.data
    new_records = {"ok": 0, "error": 0}
    hooks = _Hooks(job, summary)
    owned = executor is None
    outcome: BaseException | None = None
    tallied: tuple[dict[str, Any], dict[str, Any]] | None = None
    summary_problem: str | None = None
    try:
        executor = executor or make_executor(config, llm)
        # A reused engine has counted earlier work; throughput covers this run only.
        before = executor.stats() or {}
        try:
            run.start()
            hooks("batchgen_run_start", config=job.resolved)
            with STOP.interruptible():
                if job.todo and executor.tokenizer is None:  # nothing left (a finished run resumed): skip the model
                    t = time.perf_counter()
                    announce(f"loading model {config.model.name}", quiet)
                    executor.start()
                    run.timings["load_model_s"] = time.perf_counter() - t
                    split = getattr(executor, "thread_split", None)
                    if split:
                        announce(split, quiet)
                t_gen = time.perf_counter()
                if job.todo:
                    _generate(job, executor, quiet, new_records, hooks, max_error_rate)
                run.timings["generate_s"] = time.perf_counter() - t_gen
        except KeyboardInterrupt as exc:
            outcome = exc
        except (RunFailed, ExecutorError, OutputWriteError, PluginError) as exc:
            summary["error"] = str(exc)
            outcome = exc
        except Exception as exc:
            summary["error"] = f"{type(exc).__name__}: {exc}"
            outcome = exc
        if outcome is None or isinstance(outcome, KeyboardInterrupt):
            try:
                tallied = tally(job, with_metrics=True)
            except Exception as exc:
                if outcome is None:
                    summary["error"] = f"{type(exc).__name__}: {exc}"
                    outcome = exc
            else:
                if outcome is not None and tallied[0]["total"] >= len(job.source):
                    outcome = None  # every record is written: the run is complete, whenever a signal landed
        if outcome is None:
            assert tallied is not None
            summary["metrics"] = tallied[1]
            summary.update(adapter_metrics(job))  # a LoRA sweep: each metric per adapter too
            summary["status"] = "completed"
        elif isinstance(outcome, KeyboardInterrupt):
            summary["status"] = "interrupted"
            summary["signal"] = signal_name(getattr(outcome, "signum", None))
        else:
            summary["status"] = "failed"
        try:
            summary_problem = run.finish(executor, before, new_records, tallied)
        finally:
            if owned:
                executor.close()  # stops the replicas, on Ctrl-C too
        if outcome is None and summary_problem is None:
            try:
                hooks("batchgen_run_end", summary=summary)
            except PluginError as exc:
                # The records are complete; the summary says so and names the failed hook.
                summary_problem = run.write()
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
    records = job.records
    builder = records.builder(executor)
    prompts = job.source.prompts(executor, job.answered)
    # request id -> (its prompt, None) or, for one of a prompt's several requests, (its group, slot)
    pending: dict[Any, tuple[Any, int | None]] = {}
    error_path = config.output.error_path
    # Group commit: records finishing together (one engine step) share one fsync.
    with JsonlWriter(config.output.path, group_commit=True) as writer, (
        JsonlWriter(error_path, group_commit=True) if error_path else contextlib.nullcontext(writer)
    ) as errors, Progress(job.todo, mode="off" if quiet else None, scoring=job.scoring is not None) as progress:

        def finish(prompt: PromptRecord, output: Any | None) -> None:
            record = builder.make(prompt, output)
            failed = records.failed(record)
            (errors if failed else writer).write(record)
            new_records["error" if failed else "ok"] += 1
            progress.record_finished(_progress_tokens(job, record), failed)
            hooks("batchgen_record_finished", record=record)
            if failed:
                last_failed[0] = records.describe_error(record)
            if max_error_rate is not None:
                _check_error_rate(new_records, max_error_rate, records.example(last_failed[0] or {}))
            STOP.check()  # a signal that landed where it could not raise stops the run here

        last_failed: list[dict[str, Any] | None] = [None]

        def requests() -> Iterator[Any]:
            from batchgen.engine.outputs import Request

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

        for output in executor.stream(requests(), on_tokens=progress.on_tokens):
            entry = pending.pop(output.request_id, None)
            if entry is None:
                raise RunFailed(f"the engine returned an unknown request id {output.request_id!r}")
            target, slot = entry
            if slot is None:
                finish(target, output)
            elif target.arrived(slot, output):
                finish(target.prompt, target.outputs)
    if pending:
        raise RunFailed(f"the engine finished without returning {len(pending)} request(s), e.g. {next(iter(pending))!r}")


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
