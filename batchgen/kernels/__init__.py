"""Attention backends: the torch reference (CPU and fallback) and CUDA kernels via cupy.

``get_ops(backend)`` returns a namespace with ``reshape_and_cache``, ``paged_decode_attention``,
``paged_prefill_attention`` and ``copy_blocks``, all with the signatures of
:mod:`batchgen.kernels.reference`. Importing this package never imports cupy.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

BACKENDS = ("auto", "torch", "cuda")


def _cuda_usable() -> tuple[bool, str]:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return False, "cupy is not installed (pip install 'batchgen[cuda]')"
    return True, ""


def resolve_backend(name: str, device: Any) -> str:
    """``"auto"`` → ``"cuda"`` on a CUDA device when torch sees a GPU and cupy is installed,
    else ``"torch"``. ``"cuda"`` where that does not hold raises ValueError saying why."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {', '.join(BACKENDS)}")
    on_cuda = getattr(device, "type", str(device)).startswith("cuda")
    if name == "torch":
        return "torch"
    usable, why = _cuda_usable()
    if name == "cuda":
        if not on_cuda or not usable:
            raise ValueError(f"attention_backend 'cuda' needs a CUDA device and cupy: {why or 'the model runs on ' + str(device)}")
        return "cuda"
    return "cuda" if on_cuda and usable else "torch"


def get_ops(backend: str) -> ModuleType:
    """The module implementing the ops for a resolved backend (``"torch"`` or ``"cuda"``)."""
    if backend == "torch":
        from batchgen.kernels import reference

        return reference
    if backend == "cuda":
        from batchgen.kernels import cuda

        return cuda
    raise ValueError(f"unknown resolved backend {backend!r}; expected 'torch' or 'cuda'")
