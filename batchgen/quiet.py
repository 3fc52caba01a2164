"""Quiet: the progress bars and info logs of the libraries under us off, and batchgen's own
one-off notices (``say``) on stderr unless the run is quiet."""

from __future__ import annotations

import os
import sys

#: Set by ``batchgen ... --quiet``: :func:`say` prints nothing.
QUIET = False


def quiet_libraries() -> None:
    """Silence the progress bars and info logs of the libraries under us (transformers, the HF
    hub): a run that is quiet, not on a terminal, or inside a replica shows only its own lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def say(text: str) -> None:
    """One ``batchgen: <text>`` line on stderr (a long one-off step such as a model conversion,
    in the CLI and the Python API alike), unless :data:`QUIET` is set."""
    if not QUIET:
        print(f"batchgen: {text}", file=sys.stderr, flush=True)
