"""The batchgen cache folder, and the temp folders that killed writers leave in it.

Everything batchgen keeps between runs lives under :func:`cache_dir`: converted models, GGUF
metadata folders, compiled C kernels. A writer fills ``<target>.tmp-<pid>-*`` and renames it
into place; :func:`remove_stale_temp_folders` removes what a killed one left.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

#: A conversion temp folder older than this is stale even when its pid is alive (pids are reused).
STALE_TEMP_SECONDS = 3600.0


def cache_dir() -> Path:
    """The batchgen cache folder: ``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``."""
    env = os.environ.get("BATCHGEN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "batchgen"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


def remove_stale_temp_folders(target: Path, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Remove the ``<target>.tmp-*`` folders that killed conversions left; return them.

    A folder is stale when the pid in its name (``.tmp-<pid>-``) is not a live process, or when
    it is older than ``max_age`` seconds (the only test for a name without a pid). A folder of a
    conversion running now is kept.
    """
    removed = []
    now = time.time()
    for folder in target.parent.glob(f"{target.name}.tmp-*"):
        head = folder.name[len(target.name) + len(".tmp-") :].split("-", 1)[0]
        alive = _pid_alive(int(head)) if head.isdigit() else True
        try:
            old = now - folder.stat().st_mtime > max_age
        except OSError:
            continue
        if not alive or old:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
