"""How many threads a run uses on the CPU, and who runs them.

:func:`available_cpus` counts the CPUs this process may really use: the CPUs it is allowed to
run on (its affinity mask, as ``taskset`` or a container's cpuset sets it), capped by a CPU
quota of its cgroup (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; a container started with
``--cpus 2`` on a 64-core host gets 2), never ``os.cpu_count()``, which counts the host's.

:func:`resolve_num_threads` turns the ``num_threads`` setting into a count: ``"auto"`` is
``OMP_NUM_THREADS`` when the user set it, else :func:`available_cpus`.

:func:`apply` hands the count out. When batchgen's C kernels carry the heavy ops (the linear
layers, and with them the fused ops and attention), they run on their own pool
(``kernels/cpu/pool.h``) with every thread, and torch's intra-op pool gets one thread: what is
left to torch (embeddings, rotary embeddings, residual adds, small copies) is too small to
split, and torch's OpenMP workers keep spinning after each parallel region, on the cores the
kernels' threads need. (Measured in ``bench/results/threads.json``.) Otherwise torch gets
them all.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _cgroup_paths(proc_cgroup: str) -> tuple[list[Path], list[Path]]:
    """(v2 folders, v1 cpu-controller folders) of this process's cgroup and its ancestors,
    innermost first, from the text of ``/proc/self/cgroup``."""
    v2: list[Path] = []
    v1: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = Path(path.lstrip("/"))
        chain = [rel, *rel.parents]
        if controllers == "":
            v2 += [_CGROUP_ROOT / p for p in chain]
        elif "cpu" in controllers.split(","):
            for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                base = _CGROUP_ROOT / mount
                if base.is_dir():
                    v1 += [base / p for p in chain]
                    break
    return v2, v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit() -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 2.0 or 1.5), the tightest along
    its path; None when there is none or it cannot be read."""
    text = _read(_PROC_CGROUP)
    if text is None:
        return None
    v2, v1 = _cgroup_paths(text)
    limits: list[float] = []
    for folder in v2:
        value = _read(folder / "cpu.max")
        if value:
            quota, _, period = value.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
    for folder in v1:
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's quota (rounded up:
    a quota of 1.5 CPUs runs two threads, each at three quarters)."""
    cpus = _affinity_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def resolve_num_threads(setting: int | str | None) -> int:
    """``"auto"`` (or None): ``OMP_NUM_THREADS`` if set to a positive integer, else
    :func:`available_cpus`; an integer >= 1 is taken as it is.

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if setting is None or setting == "auto":
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) > 0:
            return int(env)
        return available_cpus()
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {setting!r}")


@dataclass(frozen=True)
class ThreadPlan:
    """Who runs on how many threads: ``kernels`` for batchgen's C kernels, ``torch`` for
    torch's intra-op pool."""

    kernels: int
    torch: int

    def describe(self) -> str:
        return f"C kernels on {self.kernels} thread(s), torch on {self.torch}"


def plan(num_threads: int, c_kernels: bool) -> ThreadPlan:
    """The split of ``num_threads`` (see the module docstring): with the C kernels carrying the
    heavy ops, they get every thread and torch one; else torch gets them all."""
    if c_kernels:
        return ThreadPlan(kernels=num_threads, torch=1)
    return ThreadPlan(kernels=num_threads, torch=num_threads)


def apply(threads: ThreadPlan) -> None:
    """Set the C kernels' pool and torch's intra-op pool to ``threads``. Both are per process:
    the last engine built sets them."""
    # deferred: torch and the CPU kernels (~5 s) only when the split is applied; threads.py stays torch-free
    import torch

    from batchgen.kernels.cpu import c_build

    c_build.set_num_threads(threads.kernels)
    if torch.get_num_threads() != threads.torch:
        torch.set_num_threads(threads.torch)
