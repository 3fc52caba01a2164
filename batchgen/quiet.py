"""Quiet libraries: the progress bars and info logs of transformers and the HF hub off."""

from __future__ import annotations

import os


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
