"""The CUDA backend's launch code on the CPU harness: a :class:`~batchgen.kernels.cuda.cuda_attention.Backend`
whose modules are :class:`cuda_harness.CpuModule` builds of the same ``.cu`` source, so that
``KernelOps(HarnessBackend(...))`` runs the real argument packing, grids and shared-memory
sizing without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from batchgen.kernels.cuda.cuda_attention import KERNEL_SOURCE, module_defines

class HarnessBackend:
    """Runs the kernels on the CPU harness (tests); schedules and poison as in CpuModule.

    ``source`` replaces the kernel file (the mutation tests build deliberately broken copies).
    """

    device_type = "cpu"

    def __init__(self, source: Path = KERNEL_SOURCE, **harness_options: Any) -> None:
        from . import CpuModule

        self._factory: Callable[..., Any] = CpuModule
        self._source = Path(source)
        self._options = harness_options
        self._modules: dict[tuple[torch.dtype, int, int], Any] = {}

    def module(self, dtype: torch.dtype, head_size: int, block_size: int) -> Any:
        key = (dtype, head_size, block_size)
        if key not in self._modules:
            self._modules[key] = self._factory(
                self._source, module_defines(dtype, head_size, block_size), **self._options
            )
        return self._modules[key]

    def arg(self, tensor: torch.Tensor) -> Any:
        return tensor

    def launch_context(self, device: torch.device) -> AbstractContextManager[Any]:
        return nullcontext()
