"""batchgen's CUDA kernels: sources and their cupy loader (the CPU harness that runs them in the
tests is tests/kernels/cuda_harness/).

* ``paged_attention.cu`` / ``paged_attention.cuh``: paged decode attention (split-K with a
  reduce), ``reshape_and_cache`` and ``copy_blocks``; their torch reference is
  :mod:`batchgen.kernels.torch_attention`.
* ``cuda_attention.py``: launches the kernels on torch tensors
  (:class:`~batchgen.kernels.cuda.cuda_attention.KernelOps`), through ``kernel_build.py``, which
  compiles the sources with NVRTC through cupy; it and ``toolchain.py`` are the only modules that
  import cupy, and only when a GPU backend is built.
* ``toolchain.py``: where NVRTC's headers are (CUDA toolkit, CUDA 12 and 13 wheels), and why the
  backend cannot build here (for ``auto``'s fallback).
* ``checks.py``: value checks of context lengths, block ids and slots before a launch.

Importing this package never imports cupy.
"""

from __future__ import annotations

from .cuda_attention import KernelInputError, KernelOps, get_cuda_ops

__all__ = ["KernelInputError", "KernelOps", "get_cuda_ops"]
