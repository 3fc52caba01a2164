"""The ``batchgen`` command line.

Commands:

* ``batchgen run CONFIG [--set KEY=VALUE ...] [--resume | --force-resume | --overwrite]
  [--max-error-rate RATE] [--quiet]``
* ``batchgen batch INPUT -o OUTPUT [--model M | --model NAME=M] [--error-file FILE]
  [--resume | --force-resume | --overwrite] [--max-error-rate RATE] [--set KEY=VALUE ...] [--quiet]``:
  an OpenAI Batch API file in, OpenAI response lines out.
* ``batchgen validate CONFIG [--set KEY=VALUE ...]``: every check that needs no model run.
* ``batchgen plugins [--json]``: what is installed, what each plugin registers, and its options.
* ``batchgen tokenize MODEL TEXT [--json]``: the token ids of TEXT under MODEL's tokenizer (for
  plugin options such as a banned token id).
* ``batchgen --version``.

Exit status: 0 ok; 1 runtime failure; 2 config or usage error (argparse's own usage errors
included, and an output in use by another run); 3 the run finished but no record succeeded,
``--max-error-rate`` stopped it, or more rows failed than ``--max-failed-rows`` allows (0 by
default for a scoring job; ``validate`` applies it to the rows it samples); 128 + the signal's
number when a signal stopped it (130 for SIGINT / Ctrl-C, 143 for SIGTERM). Errors go to stderr
as one ``batchgen: error: ...`` line, never a traceback.

One module per command group: :mod:`~batchgen.cli.run` (``run``, ``batch``),
:mod:`~batchgen.cli.validate`, :mod:`~batchgen.cli.tools` (``tokenize``, ``plugins``); what they
share (exit statuses, message lines, common flags) is :mod:`~batchgen.cli.interface`, and the
job a command reads is :mod:`~batchgen.cli.jobs`. ``lm-eval`` hands its arguments to
:mod:`batchgen.integrations.lm_eval_command`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from batchgen.cli import run, tools, validate
from batchgen.cli.interface import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE
from batchgen.integrations.lm_eval_command import main as lm_eval_main

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RECORDS_FAILED", "EXIT_USAGE", "main"]

#: Where ``--help`` sends a reader (docs/ in the source tree, or on the project's page).
_HELP_EPILOG = """\
start with:  batchgen run configs/quickstart.yaml   (an example job; bash scripts/quickstart.sh sets it up)
every key:   docs/config.md        OpenAI batch files: docs/openai-batch.md
evaluation:  docs/evaluation.md    plugins: docs/plugins.md    GGUF files: docs/gguf.md
exit status: 0 ok, 1 runtime failure, 2 config or usage error, 3 no record succeeded, 128+N a signal"""

#: Each command's handler (``lm-eval`` is no handler: :func:`main` passes it on before parsing).
_HANDLERS = {"run": run.cmd_run, "batch": run.cmd_run, "validate": validate.cmd_validate,
             "plugins": tools.cmd_plugins, "tokenize": tools.cmd_tokenize}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgen",
        description="Offline batch generation for LLMs over a paged KV cache: a YAML job in, JSON lines out.",
        epilog=_HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"batchgen {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_commands(sub)
    validate.add_command(sub)
    sub.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness with batchgen as its model: "
                   "batchgen lm-eval --model batchgen --tasks ... (docs/evaluation.md; 'batchgen lm-eval --help' "
                   "for its options)")
    tools.add_commands(sub)
    return parser


def _version() -> str:
    # deferred: importlib.metadata only for --version
    from importlib import metadata

    try:
        return metadata.version("batchgen")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it).

    Called without ``argv`` (the process's own command line), a run leaves SIGINT and SIGTERM
    ignored once its exit status is settled; with ``argv`` (a library call) it puts back the
    caller's handlers.
    """
    console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:  # lm-eval's own CLI parses the rest (batchgen.integrations.lm_eval_command)
        return lm_eval_main(argv[1:])
    args = _parser().parse_args(argv)
    args.console = console
    try:
        return _HANDLERS[args.command](args)
    except BrokenPipeError:  # e.g. `batchgen plugins | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
