"""Quiet: the progress bars and info logs of the libraries under us off, and batchgen's own
one-off notices (``say``) on stderr unless the run is quiet."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: True inside :func:`quiet_notices` (``batchgen ... --quiet``): :func:`say` prints nothing.
_QUIET: ContextVar[bool] = ContextVar("batchgen_quiet", default=False)


@contextmanager
def quiet_notices(quiet: bool = True) -> Iterator[None]:
    """Within the block, :func:`say` prints nothing when ``quiet`` is true; the setting before
    comes back on the way out (a scoped setting, not a module flag a run leaves behind)."""
    token = _QUIET.set(quiet)
    try:
        yield
    finally:
        _QUIET.reset(token)


def quiet_libraries() -> None:
    """Silence the progress bars and info logs of the libraries under us (transformers, the HF
    hub): a run that is quiet, not on a terminal, or inside a replica shows only its own lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        # deferred: transformers (~4 s) only to switch its logging off
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def is_quiet() -> bool:
    """True inside :func:`quiet_notices` (``--quiet``): batchgen's own notices stay silent."""
    return _QUIET.get()


def say(text: str) -> None:
    """One ``batchgen: <text>`` line on stderr (a long one-off step such as a model conversion,
    in the CLI and the Python API alike), unless inside :func:`quiet_notices`."""
    if not is_quiet():
        print(f"batchgen: {text}", file=sys.stderr, flush=True)
