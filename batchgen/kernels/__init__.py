"""Attention backends: ``torch`` (``torch_attention.py``), ``cpu`` (C kernels compiled at run
time, ``cpu/``) and ``cuda`` (CUDA kernels compiled at run time, ``cuda/``).

Each backend implements :class:`~batchgen.kernels.ops.AttentionOps` (``ops.py``, with the cache
layout); :func:`resolve_backend` decides which one runs and :func:`get_ops` hands it out.
``torch_attention.py`` is also the spec the kernels are tested against. ``cpu/`` and ``cuda/``
each hold their sources beside the module that builds them (`cpu/c_build.py`, `cuda/toolchain.py`).

Importing this package never imports cupy; :mod:`batchgen.kernels.cuda` does, lazily, when the
``cuda`` backend is first used.
"""

from __future__ import annotations

import importlib.util
from typing import get_args

import torch

from batchgen.backends import AttentionBackend

from .ops import AttentionOps
from .torch_attention import get_torch_ops

BACKENDS: tuple[str, ...] = get_args(AttentionBackend)


def cupy_available() -> bool:
    """Whether cupy is installed (checked without importing it)."""
    return importlib.util.find_spec("cupy") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """Turn ``attention_backend`` into ``"torch"``, ``"cpu"`` or ``"cuda"``.

    ``auto`` picks ``cuda`` when ``device`` is a CUDA device, torch sees a GPU and cupy is
    installed; ``cpu`` on a CPU device; else ``torch``. Whether the kernel can serve the model
    is the caller's next check (:func:`cpu_unsupported_reason`: dtype, shape, a C compiler;
    :func:`cuda_unsupported_reason` and :func:`cuda_unavailable_reason`: shape, NVRTC, its
    headers, the build), with ``torch`` as the fallback. ``cuda`` and ``cpu`` raise
    ``RuntimeError`` when the device does not fit, saying what is missing.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"attention_backend='cpu' needs the model on the CPU; it runs on {device}")
        return "cpu"
    usable = device.type == "cuda" and torch.cuda.is_available() and cupy_available()
    if name == "auto":
        if usable:
            return "cuda"
        return "cpu" if device.type == "cpu" else "torch"
    if device.type != "cuda":
        raise RuntimeError(f"attention_backend='cuda' needs a CUDA device; the model runs on {device}")
    if not torch.cuda.is_available():
        raise RuntimeError("attention_backend='cuda' needs a GPU, but torch sees no CUDA device")
    if not cupy_available():
        raise RuntimeError("attention_backend='cuda' needs cupy: pip install 'batchgen[cuda]'")
    return "cuda"


def cuda_unsupported_reason(dtype: torch.dtype, head_size: int, block_size: int) -> str | None:
    """Why the CUDA kernels cannot serve a model with this cache shape, or None if they can.

    Lets ``auto`` fall back to ``torch`` (and ``cuda`` fail early) instead of the first launch
    raising. Does not import cupy.
    """
    # package cycle: cpu/ and cuda/ import this package's torch_attention; each loads when picked
    from .cuda.cuda_attention import BLOCK_SIZES, DTYPE_CODES, HEAD_SIZES

    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} unsupported; the kernels support float32, float16 and bfloat16"
    if head_size not in HEAD_SIZES:
        return f"head_size {head_size} unsupported; supported: {HEAD_SIZES}"
    if block_size not in BLOCK_SIZES:
        return f"block_size {block_size} unsupported; supported: {BLOCK_SIZES}"
    return None


def cuda_unavailable_reason(dtype: torch.dtype, head_size: int, block_size: int,
                            device: torch.device, check_indices: bool = True) -> str | None:
    """Why the CUDA kernels cannot be built here for this variant, or None once they are.

    Checks that cupy imports, that NVRTC loads and that its headers are found
    (:func:`batchgen.kernels.cuda.toolchain.unavailable_reason`), then compiles the variant the
    model needs (which the first launch would do anyway; cached by cupy on disk), so a missing
    header or an NVRTC error shows up here, where ``auto`` can still fall back to ``torch``.
    """
    # package cycle: cpu/ and cuda/ import this package's torch_attention; each loads when picked
    from .cuda import get_cuda_ops, toolchain

    why = toolchain.unavailable_reason()
    if why is not None:
        return why
    ops = get_cuda_ops(check_indices)
    try:
        with ops.backend.launch_context(torch.device(device)):
            module = ops.backend.module(dtype, head_size, block_size)
            for name in ("paged_decode", "paged_decode_reduce", "reshape_and_cache", "copy_blocks"):
                module.get_function(name)  # cupy compiles lazily, on the first lookup
    except Exception as exc:  # noqa: BLE001 - NVRTC and driver errors have many types
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return f"NVRTC could not build the kernels ({type(exc).__name__}): " + " | ".join(lines[:6])
    return None


def cpu_unsupported_reason(dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the ``cpu`` kernel cannot serve a model, or None once it is built and loaded.

    Builds the kernel for this shape on first call (about a second; cached on disk after).
    """
    # package cycle: cpu/ and cuda/ import this package's torch_attention; each loads when picked
    from . import cpu

    why = cpu.unsupported_reason(dtype, head_size, num_heads, num_kv_heads)
    if why is not None:
        return why
    try:
        cpu.load(head_size, num_heads // num_kv_heads)
    except cpu.CpuKernelError as exc:
        return str(exc)
    return None


def get_ops(backend: str, check_indices: bool = True) -> AttentionOps:
    """The :class:`~batchgen.kernels.ops.AttentionOps` of a resolved backend (``reshape_and_cache``,
    ``paged_decode_attention``, ``paged_prefill_attention``, ``copy_blocks``).

    ``check_indices=False`` skips the ``cuda`` ops' value checks of context lengths, block ids
    and slots (:mod:`batchgen.kernels.cuda.checks`); the cpu backend checks always."""
    if backend == "torch":
        return get_torch_ops()
    if backend == "cpu":
        # package cycle: cpu/ and cuda/ import this package's torch_attention; each loads when picked
        from .cpu import get_cpu_ops

        return get_cpu_ops()
    if backend == "cuda":
        # package cycle: cpu/ and cuda/ import this package's torch_attention; each loads when picked
        from .cuda import get_cuda_ops

        return get_cuda_ops(check_indices)
    raise ValueError(f"backend must be 'torch', 'cpu' or 'cuda' (resolve 'auto' first); got {backend!r}")
