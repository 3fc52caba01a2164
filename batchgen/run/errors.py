"""How a run ends badly: the exceptions of the run layer, and which of them are the user's to fix.

* :data:`SETUP_ERRORS`: "fix your config or inputs" (``batchgen`` exits 2); raised by
  :func:`batchgen.run.plan.plan` before any model is loaded.
* :class:`RunFailed` (exit 1) and :class:`TooManyErrors` (exit 3): raised by
  :func:`batchgen.run.execute.execute` after it wrote a summary whose ``status`` says so.
* :class:`Interrupted`: a signal stopped the run (exit 128 + the signal's number).
"""

from __future__ import annotations

from batchgen.config import ConfigError
from batchgen.plugins import PluginError
from batchgen.io.dataset import DataError
from batchgen.io.output_file import OutputError

__all__ = ["Interrupted", "ResumeMismatchError", "RunFailed", "SETUP_ERRORS", "TooManyErrors"]


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


#: Exceptions that mean "fix your config or inputs" (exit status 2).
SETUP_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, OutputError, PluginError)
