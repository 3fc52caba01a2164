"""batchgen's CUDA kernels: sources, their cupy loader, and the CPU harness that runs them.

* ``paged_attention.cu`` / ``paged_attention.cuh``: paged decode attention (split-K with a
  reduce), ``reshape_and_cache`` and ``copy_blocks``; their torch reference is
  :mod:`batchgen.kernels.reference`.
* ``attention.py``: compiles the sources with NVRTC through cupy and launches them on torch
  tensors (:class:`~batchgen.kernels.cuda.attention.KernelOps`); with ``loader.py`` the only
  modules that import cupy, and only when a GPU backend is built.
* ``loader.py``: where NVRTC's headers are (CUDA toolkit, CUDA 12 and 13 wheels), and why the
  backend cannot build here (for ``auto``'s fallback).
* ``checks.py``: value checks of context lengths, block ids and slots before a launch.
* ``harness/``: a C++ header that runs the same ``.cu`` on the CPU, for the tests.

Importing this package never imports cupy.
"""

from __future__ import annotations

from .attention import KernelInputError, KernelOps, get_cuda_ops

__all__ = ["KernelInputError", "KernelOps", "get_cuda_ops"]
