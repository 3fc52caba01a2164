"""PackedLinear: a float32 ``nn.Linear`` on the CPU through batchgen's own GEMM (``linear.c``).

Why: a decode step multiplies a few dozen rows by every weight matrix of the model, and at
that shape torch's GEMM (MKL) runs below the core's peak (on the development machine, an AVX2
AMD EPYC, about 49 GFLOP/s for SmolLM2's ``lm_head`` and 72-74 for its layers at 32 rows). The
kernel packs each weight once, at model load, into panels of 16 output columns and runs a
6 x 16 register tile over them, prefetching the next panel while one runs. Over all of the
model's layers in order (weights streamed from memory, as in a step) it measured 1.4x MKL at
32 rows and 1.1x at 1 and 128 rows; per layer, with the weight in cache, 1.0-1.2x on the layer
shapes and 1.6x on ``lm_head`` at 32 rows (``bench/results/linear_kernel.json``).

Numerics: every output is one fused multiply-add chain over the input features, in order, plus
the bias. So a row's result does not depend on the other rows of the call (batch-invariant),
and reruns are bit-identical. It differs from MKL's sums by float32 rounding (about 1e-6
relative); greedy and beam output still match HF ``generate``, which the oracle tests check.

Threads: the kernel runs on the calling thread. With more than one torch intra-op thread,
MKL's threaded GEMM is faster, so ``linear_backend="auto"`` uses the kernel only when torch
runs one thread. It needs x86-64 with AVX2 and FMA (checked by building it) and a C compiler;
anything else keeps torch's layers. Inference only: there is no backward.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from . import loader

logger = logging.getLogger(__name__)

LINEAR_SOURCE = Path(__file__).resolve().parent / "linear.c"
LINEAR_BACKENDS = ("auto", "cpu", "torch")


def load_linear() -> Any:
    """The compiled GEMM library (built on first use, cached on disk like the attention kernel).

    Raises:
        loader.CpuKernelError: no compiler, or it would not build here (no AVX2/FMA).
    """
    return loader.load_library("the CPU linear kernel", LINEAR_SOURCE, _declare)


def _declare(lib: Any) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.batchgen_linear_packed_numel.restype = i64
    lib.batchgen_linear_packed_numel.argtypes = [i64, i64]
    lib.batchgen_linear_panel_width.restype = i64
    lib.batchgen_linear_pack_f32.restype = None
    lib.batchgen_linear_pack_f32.argtypes = [p, p, i64, i64]
    lib.batchgen_linear_f32.restype = None
    lib.batchgen_linear_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]


def unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel cannot run this model's layers, or None once it is built and loaded."""
    if torch.device(device).type != "cpu":
        return f"the model runs on {device}; the linear kernel is for the CPU"
    if dtype != torch.float32:
        return f"dtype {dtype} unsupported; the CPU linear kernel is float32 only"
    try:
        load_linear()
    except loader.CpuKernelError as exc:
        return str(exc)
    return None


def as_rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """``x`` as ``[rows, width]`` with unit column stride (a copy only when needed), for the
    C kernels; ``what`` names the caller in errors.

    Raises:
        ValueError: input of another dtype, device or width.
        RuntimeError: input that requires grad (the kernels have no backward).
    """
    if x.dtype is not torch.float32 or not x.is_cpu or x.shape[-1] != width:
        raise ValueError(f"{what} needs float32 CPU input [..., {width}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{what} is inference only (no backward); run under torch.no_grad()")
    rows = x if x.dim() == 2 else x.reshape(-1, width)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < width):
        rows = rows.contiguous()
    return rows


class PackedLinear(torch.nn.Module):
    """A float32 CPU ``nn.Linear`` whose weight is stored packed for ``linear.c``.

    ``forward(x)`` takes ``[..., in_features]`` float32 CPU input and returns
    ``[..., out_features]``, equal to ``F.linear(x, weight, bias)`` within float32 rounding.
    The unpacked weight is not kept (a weight tied to an embedding stays with the embedding).

    Raises:
        ValueError: (construction) a weight that is not float32 on the CPU; (forward) input of
            another dtype, device or width.
        RuntimeError: (forward) input that requires grad: the kernel has no backward.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        lib = load_linear()
        weight = weight.contiguous()
        packed = torch.empty(lib.batchgen_linear_packed_numel(self.out_features, self.in_features))
        lib.batchgen_linear_pack_f32(weight.data_ptr(), packed.data_ptr(), self.out_features, self.in_features)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None
        if linear.bias is not None:
            width = lib.batchgen_linear_panel_width()
            bias = torch.zeros(-(-self.out_features // width) * width)  # padded to whole panels
            bias[:self.out_features] = linear.bias.detach().float()
        self.register_buffer("padded_bias", bias, persistent=False)
        self._what = f"PackedLinear({self.in_features} -> {self.out_features})"
        self._fn = lib.batchgen_linear_f32
        self._packed_ptr = packed.data_ptr()
        self._bias_ptr = bias.data_ptr() if bias is not None else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.padded_bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~200 times per decode step: the checks stay cheap attribute reads.
        k = self.in_features
        rows = as_rows(x, k, self._what)
        m = rows.shape[0]
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32)
        if m:
            self._fn(rows.data_ptr(), rows.stride(0), self._packed_ptr, self._bias_ptr, out.data_ptr(),
                     self.out_features, m, self.out_features, k)
        return out

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch's signature
        # The kernel holds raw pointers to the packed buffers: moving or casting them would
        # leave those dangling, so refuse (a PackedLinear lives on the CPU, in float32).
        raise RuntimeError("a PackedLinear cannot be moved or cast; load the model with "
                           "linear_backend='torch' to change its device or dtype")


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` (exact type) by a PackedLinear.

    Subclasses of ``nn.Linear`` are left alone: they may change ``forward``. Layers are packed
    one at a time, each unpacked weight dropped before the next is packed (unless something
    else holds it, like an embedding tied to ``lm_head``). The remaining parameters and
    buffers are then copied out of any memory-mapped checkpoint, so that the mapping (which
    holds the unpacked weights too) is released. Returns how many layers were replaced.
    """
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
               and module.weight.device.type == "cpu"]
    count = len(targets)
    while targets:  # drop each unpacked weight as soon as its packed copy is in place
        name, module = targets.pop()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
        del module
    if count:
        # transformers may map the checkpoint file into memory, and the tensors left (the
        # embedding, the norms) would keep the whole mapping, unpacked weights included,
        # resident. Copies of their own let the mapping go.
        # (A PackedLinear's own buffers are not touched: the kernel holds their addresses.
        # ``parameters()`` lists a tied weight once, so it is copied once.)
        buffers = [b for m in model.modules() if not isinstance(m, PackedLinear) for b in m.buffers(recurse=False)]
        with torch.no_grad():
            for tensor in [*model.parameters(), *buffers]:
                if tensor.device.type == "cpu":
                    tensor.data = tensor.data.clone()
    return count


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """Turn ``linear_backend`` into ``"cpu"`` or ``"torch"``, with the reason when ``auto``
    settles on ``torch``.

    ``auto`` picks ``cpu`` for a float32 model on the CPU when torch runs one intra-op thread
    and the kernel builds here; else ``torch``.

    Raises:
        ValueError: an unknown name, or ``"cpu"`` asked for where it cannot run (the message
            says why).
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {name!r}")
    if name == "torch":
        return "torch", None
    threads = torch.get_num_threads()
    if name == "auto" and torch.device(device).type == "cpu" and threads > 1:
        return "torch", (f"torch runs {threads} threads, where its threaded GEMM beats "
                         "the single-threaded CPU linear kernel")
    why = unsupported_reason(dtype, device)
    if why is None:
        return "cpu", None
    if name == "cpu":
        raise ValueError(f"linear_backend='cpu' cannot serve this model: {why}")
    return "torch", why
