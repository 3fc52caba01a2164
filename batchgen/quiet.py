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


#: The HF hub's switch for its progress bars (read from the environment).
_HUB_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"


def quiet_libraries() -> None:
    """Silence the progress bars and info logs of the libraries under us (transformers, the HF
    hub) for the rest of the process: a run that is quiet, not on a terminal, or inside a
    replica shows only its own lines. A library step uses :func:`libraries_quiet` instead."""
    os.environ.setdefault(_HUB_BARS, "1")
    try:
        # deferred: transformers (~4 s) only to switch its logging off
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


@contextmanager
def progress_bars_off() -> Iterator[None]:
    """transformers' progress bars off within the block, as they were before afterwards (the
    model's load: its "Loading weights" bars are no output of ours)."""
    # deferred: transformers (~4 s) only to switch its bars off for a while
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def libraries_quiet() -> Iterator[None]:
    """:func:`quiet_libraries` for the block only: on the way out transformers' progress bars
    (:func:`progress_bars_off`), its log verbosity and ``HF_HUB_DISABLE_PROGRESS_BARS`` are what
    they were before, so a library step (reading a GGUF file's metadata) quiets it without
    turning a Python API user's bars and logs off for the rest of their process."""
    # deferred: transformers (~4 s) only to switch its logging off for a while
    from transformers.utils import logging as hf_logging

    env, verbosity = os.environ.get(_HUB_BARS), hf_logging.get_verbosity()
    with progress_bars_off():
        quiet_libraries()
        try:
            yield
        finally:
            if env is None:
                os.environ.pop(_HUB_BARS, None)
            else:
                os.environ[_HUB_BARS] = env
            hf_logging.set_verbosity(verbosity)


def is_quiet() -> bool:
    """True inside :func:`quiet_notices` (``--quiet``): batchgen's own notices stay silent."""
    return _QUIET.get()


def say(text: str) -> None:
    """One ``batchgen: <text>`` line on stderr (a long one-off step such as a model conversion,
    in the CLI and the Python API alike), unless inside :func:`quiet_notices`."""
    if not is_quiet():
        print(f"batchgen: {text}", file=sys.stderr, flush=True)
