"""Where the kernel tests run: CPU-harness ops under the required schedules, or real cupy."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cuda_harness.backend import HarnessBackend

from batchgen.kernels.cuda.cuda_attention import KernelOps

# The CPU harness schedules every case runs under (each is warp-by-warp; see cuda_cpu.h).
CPU_SCHEDULES = (("warp", "nan"), ("warp_reverse", "huge"))

_harness_ops: dict[tuple[str, str], KernelOps] = {}


def harness_ops(schedule: str, poison: str) -> KernelOps:
    """KernelOps on the CPU harness (modules are built once per variant and cached on disk)."""
    key = (schedule, poison)
    if key not in _harness_ops:
        _harness_ops[key] = KernelOps(HarnessBackend(schedule=schedule, poison=poison))
    return _harness_ops[key]


def gpu_skip_reason() -> str | None:
    """Why the GPU variant of the tests cannot run here, or None if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'batchgen[cuda]')"
    return None


@dataclass
class Runner:
    """Where a kernel test runs: the device for its tensors and the ops to compare."""

    name: str
    device: torch.device
    ops: list[tuple[str, KernelOps]] = field(default_factory=list)


def prebuild(variants: Iterable[tuple[torch.dtype, int, int]]) -> None:
    """Build the CPU modules of ``variants`` two at a time (the machine has two cores)."""
    backend = harness_ops(*CPU_SCHEDULES[0]).backend
    todo = list(dict.fromkeys(variants))
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda v: backend.module(*v), todo))
    for schedule, poison in CPU_SCHEDULES[1:]:  # same files: only loads, no compilation
        other = harness_ops(schedule, poison).backend
        for v in todo:
            other.module(*v)
