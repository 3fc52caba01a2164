"""``batchgen lm-eval ARGS...``: lm-eval's own command line, with the model ``batchgen`` registered.

lm-eval 0.4.13 reads no entry points for models, so ``lm-eval --model batchgen`` alone cannot
find batchgen; this command imports :mod:`batchgen.integrations.lm_eval` (which registers it)
and hands every argument, untouched, to lm-eval's CLI (``lm_eval.__main__.cli_evaluate``,
which reads ``sys.argv``). Its subcommands (``run``, ``ls``, ``validate``) and its legacy form
without a subcommand work as they do under ``lm-eval``; exit statuses are lm-eval's.

A task whose dataset is on the Hugging Face Hub cannot load when the hub cannot be reached
(offline, ``HF_HUB_OFFLINE=1``) and was never cached: ``datasets`` raises ``ConnectionError``,
which this command reports as one line pointing to a local task (``--include_path``) and exits 1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run lm-eval's CLI on ``argv`` (the arguments after ``lm-eval``); returns its exit status."""
    try:
        # deferred: lm-eval (~2 s, an extra) only when the command runs; `batchgen` starts without it
        import batchgen.integrations.lm_eval  # noqa: F401  (registers the model "batchgen")
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        print(f"batchgen lm-eval: {exc}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = ["batchgen lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help and errors, lm-eval's own exits
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ConnectionError as exc:  # a hub task's dataset, with the hub out of reach
        print(f"batchgen lm-eval: error: {exc}; a task whose dataset is on the Hugging Face Hub needs the hub "
              "once (datasets then caches it); offline, run a local task with --include_path (see "
              "docs/evaluation.md, 'Offline: a local task')", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0
