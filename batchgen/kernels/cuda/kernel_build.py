"""The CUDA attention kernels' build: the source, its configuration, and the runtimes that compile it.

``paged_attention.cu`` with ``paged_attention.cuh`` pasted in (:func:`full_source`: cupy's compile
cache is keyed by the source text, so editing either file recompiles), the constants mirrored
from the header, the shared-memory sizes and split-K partitions of a launch, the ``-D`` defines of
one compiled variant (dtype, head size, block size), and the :class:`Backend` protocol with its
GPU runtime, :class:`CupyBackend` (NVRTC through ``cupy.RawModule``, launches on torch's current
stream). :mod:`.cuda_attention` launches the kernels through a :class:`Backend` and re-exports
these names.

cupy is imported only inside :class:`CupyBackend` here (and inside :mod:`.toolchain`'s functions).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from . import toolchain

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_SOURCE = KERNEL_DIR / "paged_attention.cu"
KERNEL_HEADER = KERNEL_DIR / "paged_attention.cuh"

# Mirrors of paged_attention.cuh (tests/kernels pins them to the header).
NUM_THREADS = 128
NUM_WARPS = NUM_THREADS // 32
MAX_GROUP = 8
TILE = 64
# Tokens per split-K partition. A multiple of TILE; small enough that one 8K-token sequence
# spreads over 32 blocks per KV head, large enough that the reduce stays a small fraction.
PARTITION_SIZE = 256
# Partition size used when no sequence of the launch needs more than one partition.
_SINGLE_PASS = 2**31 - 1

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
COPY_THREADS = 256


def decode_smem_bytes(head_size: int, element_size: int) -> int:
    """Dynamic shared memory of ``paged_decode`` (see the layout comment in the .cu file)."""
    v_slots = NUM_THREADS // (head_size * element_size // 16)  # BG_V_SLOTS
    loop = MAX_GROUP * head_size + MAX_GROUP * TILE
    return 4 * (3 * MAX_GROUP + TILE + max(loop, v_slots * MAX_GROUP * head_size))


def reduce_smem_bytes(max_parts: int) -> int:
    """Dynamic shared memory of ``paged_decode_reduce``."""
    return 4 * (2 * NUM_WARPS + max_parts)


def num_partitions(context_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """Partitions a sequence of ``context_len`` tokens is split into (1 = single pass)."""
    return max(1, math.ceil(context_len / partition_size))


def module_defines(dtype: torch.dtype, head_size: int, block_size: int) -> dict[str, int]:
    """The -D macros that select one compiled variant."""
    return {"BG_DTYPE": DTYPE_CODES[dtype], "BG_HEAD_SIZE": head_size, "BG_BLOCK_SIZE": block_size}


def full_source() -> str:
    """The kernel source with the project header inlined.

    cupy's compile cache is keyed by the source text and options, not by included files, so the
    header is pasted in: editing it then invalidates the cached binaries as it should.
    """
    text = KERNEL_SOURCE.read_text()
    return text.replace('#include "paged_attention.cuh"', KERNEL_HEADER.read_text(), 1)

class Backend(Protocol):
    """What :class:`KernelOps` needs from a kernel runtime (cupy on a GPU, the CPU harness)."""

    device_type: str

    def module(self, dtype: torch.dtype, head_size: int, block_size: int) -> Any:
        """A compiled module with ``get_function(name)`` returning a RawKernel-like callable."""

    def arg(self, tensor: torch.Tensor) -> Any:
        """The kernel argument for a tensor (a device array or the tensor itself)."""

    def launch_context(self, device: torch.device) -> AbstractContextManager[Any]:
        """Context in which launches go to torch's current stream of ``device``."""


class CupyBackend:
    """Compiles with ``cupy.RawModule`` (NVRTC) and launches on torch's current stream."""

    device_type = "cuda"

    def __init__(self) -> None:
        try:
            import cupy  # noqa: F401  (optional dependency, imported only here)
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(f"attention_backend='cuda' needs cupy: {toolchain.INSTALL_HINT}") from exc
        self._cupy = cupy
        self._modules: dict[tuple[torch.dtype, int, int, int], Any] = {}

    def module(self, dtype: torch.dtype, head_size: int, block_size: int) -> Any:
        dev = self._cupy.cuda.runtime.getDevice()
        key = (dtype, head_size, block_size, dev)
        mod = self._modules.get(key)
        if mod is None:
            version = toolchain.nvrtc_version()
            major = version[0] if version else None
            includes = toolchain.nvrtc_include_dirs(major)
            if not includes:
                raise RuntimeError(toolchain.missing_headers_reason(major))
            # One directory only: two CUDA installs' headers must never mix.
            options = ["-std=c++17", f"-I{includes[0]}"]
            options += [f"-D{k}={v}" for k, v in module_defines(dtype, head_size, block_size).items()]
            mod = self._cupy.RawModule(code=full_source(), options=tuple(options))
            self._modules[key] = mod
        return mod

    def arg(self, tensor: torch.Tensor) -> Any:
        # cupy has no bfloat16; the kernels only need the address, so hand over bytes.
        flat = tensor.detach()
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        return self._cupy.from_dlpack(flat)

    def launch_context(self, device: torch.device) -> AbstractContextManager[Any]:
        stream = torch.cuda.current_stream(device)
        return _Stacked(self._cupy.cuda.Device(device.index), self._cupy.cuda.ExternalStream(stream.cuda_stream))


class _Stacked(AbstractContextManager):
    """Enters several context managers in order (device, then stream)."""

    def __init__(self, *managers: AbstractContextManager[Any]) -> None:
        self._managers = managers

    def __enter__(self) -> _Stacked:
        for m in self._managers:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._managers):
            m.__exit__(*exc)

