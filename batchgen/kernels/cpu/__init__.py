"""batchgen's C kernels for the CPU, each source beside its Python side (the torch references of
linear.c and fused.c are in tests/kernels/cpu_reference.py).

* ``c_build.py``: builds each C source with the system compiler and loads it with ctypes.
* ``paged_attention.c`` / ``cpu_attention.py``: paged decode and prefill attention (the ``cpu``
  attention backend); its torch reference is :mod:`batchgen.kernels.torch_attention`, shared
  with the CUDA kernels.
* ``linear.c`` / ``linear.py``: the GEMM behind ``linear_backend="cpu"`` (:class:`PackedLinear`).
* ``fused.c`` / ``fused.py``: RMSNorm, SiLU·up, RoPE with the KV-cache write, and the greedy
  pick.
* ``exp.h``: the vectorisable ``exp`` the sources share.

Importing this package imports torch but builds nothing; each library is built on first use.
"""

from __future__ import annotations

from .cpu_attention import CpuOps, get_cpu_ops, load, unsupported_reason
from .c_build import CpuKernelError, compiler, load_library

__all__ = ["CpuKernelError", "CpuOps", "compiler", "get_cpu_ops", "load", "load_library", "unsupported_reason"]
