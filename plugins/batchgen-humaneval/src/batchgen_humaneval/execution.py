"""Running untrusted generated code: a subprocess with a timeout and resource limits.

The code never runs in batchgen's process. Each program is written to a fresh temporary folder
and run by a new interpreter (``python -I -B``: no user site-packages, no PYTHONPATH, no
bytecode files) with:

* ``RLIMIT_AS`` (address space) = ``memory_mb``: an allocation beyond it raises MemoryError;
* ``RLIMIT_CPU`` = the timeout rounded up, plus one second: a busy loop gets SIGXCPU even if the
  wall-clock kill below were missed;
* ``RLIMIT_FSIZE``: files (including the captured output) are capped;
* ``RLIMIT_NPROC``: a small cap on new processes and threads (not enforced for root);
* ``RLIMIT_CORE`` = 0: no core dumps;
* a wall-clock timeout, after which the whole process group (the child starts its own session)
  is killed with SIGKILL, so children it forked die too;
* a minimal environment and the temporary folder as working directory, removed afterwards.

This limits accidents (loops, memory blow-ups, runaway output). It is not a security boundary:
the code still runs as the current user with network and filesystem access. Run untrusted
models' code in a container or VM.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["passed", "failed", "timeout"]

#: Cap on files the program writes, its captured stdout/stderr included.
MAX_FILE_BYTES = 16 * 2**20
#: Cap on processes/threads the program may start (RLIMIT_NPROC counts the user's processes).
MAX_PROCESSES = 64
#: How much of the output tail is kept as the failure detail.
DETAIL_CHARS = 2000


@dataclass(frozen=True)
class ExecutionResult:
    """The outcome of one program.

    Attributes:
        status: ``passed`` (exit code 0), ``failed`` (non-zero exit, or killed by a limit other
            than the wall-clock timeout) or ``timeout``.
        detail: The tail of the program's combined stdout and stderr, or how it was killed.
        returncode: The exit code; negative for a signal; None after a timeout kill.
    """

    status: Status
    detail: str
    returncode: int | None


def _limit(kind: int, value: int) -> None:
    """Lower both limits of ``kind`` to ``value`` (never above the current hard limit)."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _make_preexec(memory_bytes: int, cpu_seconds: int) -> Callable[[], None]:
    """The function run in the child between fork and exec: it applies the limits.

    It calls only ``resource.setrlimit`` (no locks, no allocation-heavy work), which is what
    makes ``preexec_fn`` safe enough in a process that also runs threads.
    """

    def apply_limits() -> None:
        _limit(resource.RLIMIT_AS, memory_bytes)
        _limit(resource.RLIMIT_CPU, cpu_seconds)
        _limit(resource.RLIMIT_FSIZE, MAX_FILE_BYTES)
        _limit(resource.RLIMIT_NPROC, MAX_PROCESSES)
        _limit(resource.RLIMIT_CORE, 0)

    return apply_limits


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def run_program(program: str, timeout_s: float, memory_mb: int) -> ExecutionResult:
    """Run ``program`` (Python source) in a sandboxed subprocess and report how it ended.

    Args:
        program: The full program; it passes when it exits with status 0.
        timeout_s: Wall-clock limit in seconds, interpreter start-up included.
        memory_mb: Address-space limit of the child in MiB (the interpreter itself needs ~30).
    """
    with tempfile.TemporaryDirectory(prefix="batchgen-exec-") as folder:
        source = Path(folder) / "program.py"
        source.write_text(program, encoding="utf-8")
        output_path = Path(folder) / "output.txt"
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": folder, "TMPDIR": folder}
        with open(output_path, "wb") as output:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(source)],
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: the timeout kills its children too
                preexec_fn=_make_preexec(memory_mb * 2**20, math.ceil(timeout_s) + 1),
            )
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            _kill_group(proc.pid)  # also reaps stray children of a program that exited
            proc.wait()
        with open(output_path, "rb") as handle:
            handle.seek(max(0, output_path.stat().st_size - DETAIL_CHARS))
            tail = handle.read().decode("utf-8", "replace").strip()
    if returncode is None:
        return ExecutionResult("timeout", f"timed out after {timeout_s:g} s", None)
    if returncode == 0:
        return ExecutionResult("passed", tail, 0)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        detail = f"killed by {name}" + (f"; output: {tail}" if tail else "")
        return ExecutionResult("failed", detail, returncode)
    return ExecutionResult("failed", tail or f"exit status {returncode}", returncode)
