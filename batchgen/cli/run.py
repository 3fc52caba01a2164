"""``batchgen run CONFIG`` and ``batchgen batch INPUT -o OUTPUT``: plan the job, run it, and
end with its report and exit status.

``run`` reads a YAML job; ``batch`` builds one from an OpenAI Batch API input file and its flags
(:func:`batchgen.cli.jobs.batch_config`). Both then take the same way through
:func:`batchgen.run.plan.plan` and :func:`batchgen.run.execute.execute`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from batchgen.cli.interface import (
    EXIT_FAILED, EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE, add_config_args, add_failed_rows_arg, add_run_args, error,
    note,
)
from batchgen.cli.jobs import batch_config, files, in_file, load, with_if_exists
from batchgen.quiet import quiet_libraries, quiet_notices

__all__ = ["add_commands", "cmd_run"]

_RUN_EPILOG = """\
CONFIG is a YAML job: which model (model.name), which rows (data.source), how a row becomes a
prompt (prompt), how to generate (generation) and where the records go (output.path), e.g.

  model: {name: smollm2-135m-instruct}
  data: {source: rows.jsonl}
  prompt: {column: prompt}
  generation: {mode: greedy, max_tokens: 64}
  output: {path: out/results.jsonl}

configs/quickstart.yaml is a complete one and configs/ holds more; docs/config.md lists every key.
batchgen validate CONFIG checks one without loading the model. Records are written in the order
they finish, one JSON line each; sort them by "id" (or "index") when the order matters."""


def add_commands(sub: Any) -> None:
    """Add ``run`` and ``batch`` to the subcommands ``sub``."""
    run = sub.add_parser("run", help="generate for every row of the dataset",
                         description="Generate (or score) for every row of the job's dataset and write one record per row.",
                         epilog=_RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(run)
    add_run_args(run, "ids")

    batch = sub.add_parser(
        "batch", help="answer an OpenAI Batch API input file (a drop-in for 'vllm run-batch')",
        description="Answer every line of an OpenAI Batch API input file (/v1/chat/completions and "
        "/v1/completions) and write OpenAI-shaped output lines as they finish. A bad line gets its own "
        "status-400 output line; the others run.",
    )
    batch.add_argument("input", metavar="INPUT", help="the batch input file (JSONL)")
    batch.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="the output file (JSONL)")
    batch.add_argument(
        "--model", dest="models", action="append", default=[], metavar="MODEL | NAME=MODEL",
        help="the model to run (default: the embedded SmolLM2-135M-Instruct); NAME=MODEL also answers "
        "lines whose 'model' is NAME with MODEL; repeatable",
    )
    batch.add_argument(
        "--lora", dest="loras", action="append", default=[], metavar="NAME=PATH",
        help="a LoRA adapter (PEFT folder) that lines whose 'model' is NAME run under, as vllm serve "
        "--lora-modules; repeatable",
    )
    batch.add_argument("--error-file", metavar="FILE", help="write failed requests here instead of to OUTPUT")
    batch.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.max_num_seqs=64 (VALUE is parsed as YAML); repeatable",
    )
    add_failed_rows_arg(batch)
    add_run_args(batch, "custom_ids")


def cmd_run(args: argparse.Namespace) -> int:
    """``run`` and ``batch``, with the signal handling of a run around them."""
    # deferred (start-up): the run layer (~1.4 s) only for run and batch
    from batchgen.run.signals import STOP

    STOP.install()
    try:
        with quiet_notices(bool(args.quiet)):
            return _run(args, STOP)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None) or STOP.received or signal.SIGINT
        error(f"interrupted by {signal.Signals(signum).name}; nothing was started")
        return 128 + signum
    finally:
        # On the command line the exit status is settled now: later signals are ignored.
        STOP.uninstall(ignore=args.console)


def _run(args: argparse.Namespace, stop: Any) -> int:
    # deferred (start-up): the run layer (~1.4 s) only for run and batch
    from batchgen.io.output_file import OutputWriteError
    from batchgen.run.errors import SETUP_ERRORS, RunFailed, TooManyErrors
    from batchgen.run.execute import execute
    from batchgen.run.plan import plan

    if args.quiet or not sys.stderr.isatty():
        quiet_libraries()  # before plan: converting the embedded model draws bars too
    try:
        with stop.interruptible():
            registry, config = batch_config(args) if args.command == "batch" else load(args)
            config = with_if_exists(config, args)
            job = plan(config, registry, config_path=getattr(args, "config", None), force_resume=args.force_resume)
    except SETUP_ERRORS as exc:
        error(in_file(exc, getattr(args, "config", None) or "batchgen batch"))
        return EXIT_USAGE
    except OutputWriteError as exc:  # the sidecar could not be written (a full disk): nothing generated
        error(str(exc))
        return EXIT_FAILED
    try:
        summary = execute(job, quiet=args.quiet, max_error_rate=args.max_error_rate)
    except TooManyErrors as exc:
        error(f"run stopped: {exc}")
        note(f"the records written so far are kept in {files(config)}")
        return EXIT_RECORDS_FAILED
    except RunFailed as exc:
        error(f"run failed: {exc}")
        note(f"records written so far are kept; fix the cause and rerun with --resume ({config.output.path})")
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None) or signal.SIGINT
        error(
            f"interrupted by {signal.Signals(signum).name}; the summary says 'interrupted'; "
            f"rerun with --resume to continue ({config.output.path})"
        )
        return 128 + signum
    return _ended(args, stop, summary, config, job)


def _ended(args: argparse.Namespace, stop: Any, summary: dict[str, Any], config: Any, job: Any) -> int:
    """The report and exit status of a run that ran to its end."""
    if stop.received is not None:
        note(f"{signal.Signals(stop.received).name} arrived once every record was written: the run is "
             "complete, and the summary says 'completed'")
    if not args.quiet:
        _report(summary, config, job)
    records = summary["records"]
    status = _failed_rows(records, job, args.max_failed_rows, args.quiet)
    if status is not None:
        return status
    if records["total"] and not records["ok"]:
        example = records.get("first_error") or {}
        error(
            f"no record succeeded: all {records['total']} records in {files(config)} are errors, "
            f"e.g. {job.records.example(example)}"
        )
        return EXIT_RECORDS_FAILED
    return EXIT_OK


def _failed_rows(records: dict[str, Any], job: Any, given: int | None, quiet: bool) -> int | None:
    """Say how many rows failed and why (an error always, a note unless quiet);
    EXIT_RECORDS_FAILED when they break ``--max-failed-rows``
    (:func:`batchgen.run.failures.verdict`), else None."""
    # deferred (start-up): the run layer (~1.4 s) only once a run has records
    from batchgen.run.failures import verdict

    said = verdict(records, job.scoring is not None, given, job.records.example, files(job.config))
    if said is None:
        return None
    text, over = said
    if over:
        error(text)
        return EXIT_RECORDS_FAILED
    if records["ok"] and not quiet:
        note(text)
    return None


def _report(summary: dict[str, Any], config: Any, job: Any) -> None:
    """The final report: what was written where, the throughput, the metrics and the summary's path."""
    records = summary["records"]
    speed = summary["throughput"]
    ok, errors = records["this_run_ok"], records["this_run_error"]
    if config.output.error_path:
        # Each file gets its own count: the ok records in one, the failed ones in the other.
        wrote = (f"wrote {ok} record(s) to {config.output.path}, {errors} error{'' if errors == 1 else 's'} to "
                 f"{config.output.error_path} ({records['resumed']} already there)")
    else:
        wrote = (f"wrote {records['this_run']} record(s) to {config.output.path} "
                 f"({ok} ok, {errors} error; {records['resumed']} already there)")
    print(f"{wrote} in {summary['timings']['total_s']:.1f}s")
    if job.scoring is not None:  # nothing is generated: what counts is the prompt tokens scored
        print(f"throughput: {speed['prompt_tokens_per_s']:.1f} tok/s scored, "
              f"{speed['prefill_tokens_per_s']:.1f} tok/s computed (the rest from the prefix cache)")
    else:
        print(
            f"throughput: {speed['generated_tokens_per_s']:.1f} generated tok/s, "
            f"{speed['prompt_tokens_per_s']:.1f} prompt tok/s"
        )
    _report_metrics(summary, job)
    print(f"summary: {config.output.summary_file}")


def _report_metrics(summary: dict[str, Any], job: Any) -> None:
    """The metrics: an evaluation run's results table, a LoRA sweep's table, or one line per metric."""
    if job.scoring is not None and summary.get("metrics"):  # an evaluation run: lm-eval's results table
        # deferred (start-up): the scoring records only for an evaluation run's table
        from batchgen.run.scoring_records import results_table

        print(results_table(summary["metrics"], summary.get("metric_rows")))
    if summary.get("metrics_by_adapter"):  # a LoRA sweep: one column per adapter
        # deferred (start-up): the run layer only for a sweep's table
        from batchgen.run.adapters import adapter_table

        print(adapter_table(summary["metrics_by_adapter"]))
    for key, values in ({} if job.scoring is not None else summary.get("metrics") or {}).items():
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        rows = (summary.get("metric_rows") or {}).get(key)
        print(f"{key}: {shown}" + (f" ({rows['rows']} rows, {rows['failed']} failed)" if rows else ""))
