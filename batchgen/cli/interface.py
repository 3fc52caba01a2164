"""What every ``batchgen`` command shares: its exit statuses, its one-line messages on stderr,
and the flags several commands take (``CONFIG`` and ``--set``, ``--max-failed-rows``, and the
run flags of ``run`` and ``batch``)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RECORDS_FAILED", "EXIT_USAGE", "add_config_args",
           "add_failed_rows_arg", "add_run_args", "error", "note"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RECORDS_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM gives 143


def error(message: str, stream: TextIO | None = None) -> None:
    """Print the one ``batchgen: error: ...`` line a failing command ends with."""
    print(f"batchgen: error: {message}", file=stream or sys.stderr)


def note(message: str) -> None:
    """Print a ``batchgen: ...`` line on stderr."""
    print(f"batchgen: {message}", file=sys.stderr)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``CONFIG``, ``--max-failed-rows`` and ``--set`` (``run`` and ``validate``)."""
    p.add_argument("config", metavar="CONFIG", help="the run's YAML file")
    add_failed_rows_arg(p)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set data.limit=5 (VALUE is parsed as YAML); repeatable",
    )


def add_run_args(p: argparse.ArgumentParser, ids: str) -> None:
    """What to do with an existing output, ``--max-error-rate`` and ``--quiet`` (``run`` and
    ``batch``; ``ids`` names what a resume skips)."""
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help=f"skip the {ids} already in the output file")
    mode.add_argument(
        "--force-resume",
        action="store_true",
        help="resume even though the earlier run's generation config differs (records of both kinds end up in one file)",
    )
    mode.add_argument("--overwrite", action="store_true", help="start the output file over")
    p.add_argument(
        "--max-error-rate",
        type=_rate,
        default=None,
        metavar="RATE",
        help="stop (exit 3) once more than this share (0..1) of the records written are errors, "
        "checked from the 10th record on",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output and no final report")


def add_failed_rows_arg(p: argparse.ArgumentParser) -> None:
    """``--max-failed-rows N`` (``run``, ``batch`` and ``validate``)."""
    p.add_argument(
        "--max-failed-rows", type=_count, default=None, metavar="N",
        help="exit 3 when more than N rows failed (their error records are written); default 0 for "
        "a scoring job (generation.mode loglikelihood/perplexity), no limit for a generation job",
    )


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows (0 or more), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows (0 or more), got {text!r}")
    return value
