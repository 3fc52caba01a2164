"""PackedLinear: an ``nn.Linear`` on the CPU through batchgen's own GEMM (``linear.c``), in
float32, bfloat16 or float16, on the kernels' thread pool.

Why: a decode step multiplies a few dozen rows by every weight matrix of the model, and at
that shape torch's GEMM runs below the core's peak. The kernel packs each weight once, at model
load, into panels of 16 output columns and runs a register tile over them (float32: 6 x 16
AVX2 FMA; bfloat16: 12 x 16 AVX512-BF16 dot products where the CPU has them, else the weights
converted to float32 as they load), prefetching the next panel while one runs. Figures are in
``docs/kernels.md`` and ``bench/results/linear_kernel*.json``.

Numerics: every output is one chain of multiply-adds over the input features, in order, in
float32, plus the bias; a 16-bit output is rounded once at the end. The threads split the
output columns and rows, never that sum, so a row's result does not depend on the other rows
of the call (batch-invariant) nor on the thread count, and reruns are bit-identical. It
differs from torch's GEMM by float32 rounding (about 1e-6 relative); greedy and beam output
still match HF ``generate`` in float32, which the oracle tests check.

Threads: :func:`batchgen.kernels.cpu.c_build.set_num_threads`. The CPU must have AVX2, FMA and
F16C (checked at run time, before building, and again by the built library); anything else keeps
torch's layers, with the reason logged. Inference only: there is no backward.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, get_args

import torch

from batchgen.backends import LinearBackend

from . import c_build

logger = logging.getLogger(__name__)

LINEAR_SOURCE = Path(__file__).resolve().parent / "linear.c"
LINEAR_BACKENDS: tuple[str, ...] = get_args(LinearBackend)
REQUIRED_FEATURES = ("avx2", "fma", "f16c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's dtype codes


ISAS = {"native": (), "avx2": ("-mno-avx512f",)}  # extra compiler flags of each build


def load_linear(isa: str = "native") -> Any:
    """The compiled GEMM library (built on first use, cached on disk like the other kernels):
    ``isa="native"`` for everything this CPU has (AVX-512 and AVX512-BF16 included), ``"avx2"``
    for the AVX2 code alone (what a CPU without AVX-512 runs; the tests compare the two).

    Raises:
        c_build.CpuKernelError: the CPU lacks AVX2/FMA/F16C, no compiler, or it would not build.
    """
    missing = c_build.missing_cpu_features(*REQUIRED_FEATURES)
    if missing:
        raise c_build.CpuKernelError(missing)
    return c_build.load_library("the CPU linear kernel", LINEAR_SOURCE, _declare, ISAS[isa],
                               accept=_runs_here, tag="" if isa == "native" else isa)


_runs_here = c_build.runs_here("batchgen_linear_cpu_ok")


def _declare(lib: Any) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.batchgen_linear_packed_numel.restype = i64
    lib.batchgen_linear_packed_numel.argtypes = [i64, i64, i32]
    lib.batchgen_linear_panel_width.restype = i64
    lib.batchgen_linear_native_bf16.restype = i32
    lib.batchgen_linear_pack_f32.restype = None
    lib.batchgen_linear_pack_f32.argtypes = [p, p, i64, i64]
    lib.batchgen_linear_pack_16.restype = None
    lib.batchgen_linear_pack_16.argtypes = [p, p, i64, i64, i32]
    lib.batchgen_linear_f32.restype = None
    lib.batchgen_linear_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
    lib.batchgen_linear_16.restype = i32
    lib.batchgen_linear_16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32]


def unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel cannot run this model's layers, or None once it is built and loaded."""
    if torch.device(device).type != "cpu":
        return f"the model runs on {device}; the linear kernel is for the CPU"
    if dtype not in DTYPES:
        return f"dtype {dtype} unsupported; the CPU linear kernel runs float32, bfloat16 and float16"
    try:
        load_linear()
    except c_build.CpuKernelError as exc:
        return str(exc)
    return None


def bf16_path() -> str:
    """How bfloat16 runs here: ``"avx512_bf16"`` (native dot products) or ``"avx2"``
    (converted to float32); builds the library if needed."""
    return "avx512_bf16" if load_linear().batchgen_linear_native_bf16() else "avx2"


def as_rows(x: torch.Tensor, width: int, what: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` as ``[rows, width]`` with unit column stride (a copy only when needed), for the
    C kernels; ``what`` names the caller in errors; ``dtype`` is the one the kernel expects.

    Raises:
        ValueError: input of another dtype, device or width.
        RuntimeError: input that requires grad (the kernels have no backward).
    """
    if x.dtype is not dtype or not x.is_cpu or x.shape[-1] != width:
        raise ValueError(f"{what} needs {str(dtype).removeprefix('torch.')} CPU input [..., {width}], "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{what} is inference only (no backward); run under torch.no_grad()")
    rows = x if x.dim() == 2 else x.reshape(-1, width)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < width):
        rows = rows.contiguous()
    return rows


class PackedLinear(torch.nn.Module):
    """A CPU ``nn.Linear`` (float32, bfloat16 or float16) whose weight is stored packed for
    ``linear.c``.

    ``forward(x)`` takes ``[..., in_features]`` CPU input of the weight's dtype and returns
    ``[..., out_features]`` of that dtype, equal to ``F.linear(x, weight, bias)`` within
    rounding (float32 sums; see the module docstring). The unpacked weight is not kept (a
    weight tied to an embedding stays with the embedding).

    Raises:
        ValueError: (construction) a weight of another dtype, or not on the CPU; (forward)
            input of another dtype, device or width.
        RuntimeError: (forward) input that requires grad: the kernel has no backward.
        MemoryError: (forward, 16-bit without native bfloat16) no memory for the input's
            float32 copy.
    """

    def __init__(self, linear: torch.nn.Linear, isa: str = "native") -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype not in DTYPES or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a float32, bfloat16 or float16 CPU weight, "
                             f"got {weight.dtype} on {weight.device}")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        lib = load_linear(isa)
        code = DTYPES[self.dtype]
        weight = weight.contiguous()
        packed = torch.empty(lib.batchgen_linear_packed_numel(self.out_features, self.in_features, code),
                             dtype=self.dtype)
        if self.dtype == torch.float32:
            lib.batchgen_linear_pack_f32(weight.data_ptr(), packed.data_ptr(), self.out_features, self.in_features)
        else:
            lib.batchgen_linear_pack_16(weight.data_ptr(), packed.data_ptr(), self.out_features,
                                        self.in_features, code)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None
        if linear.bias is not None:  # float32, padded to whole panels, whatever the dtype
            width = lib.batchgen_linear_panel_width()
            bias = torch.zeros(-(-self.out_features // width) * width)
            bias[:self.out_features] = linear.bias.detach().float()
        self.register_buffer("padded_bias", bias, persistent=False)
        self._what = f"PackedLinear({self.in_features} -> {self.out_features}, {self.dtype})"
        self._code = code
        self._fn = lib.batchgen_linear_f32 if code == 0 else lib.batchgen_linear_16
        self._packed_ptr = packed.data_ptr()
        self._bias_ptr = bias.data_ptr() if bias is not None else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.padded_bias is not None}, dtype={self.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~200 times per decode step: the checks stay cheap attribute reads.
        k = self.in_features
        rows = as_rows(x, k, self._what, self.dtype)
        m = rows.shape[0]
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=self.dtype)
        if m:
            args = (rows.data_ptr(), rows.stride(0), self._packed_ptr, self._bias_ptr, out.data_ptr(),
                    self.out_features, m, self.out_features, k)
            if self._code == 0:
                self._fn(*args)
            elif self._fn(*args, self._code) != 0:
                raise MemoryError(f"{self._what}: no memory for a float32 copy of {m} x {k} inputs")
        return out

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch's signature
        # The kernel holds raw pointers to the packed buffers: moving or casting them would
        # leave those dangling, so refuse (a PackedLinear stays on the CPU, in its dtype).
        raise RuntimeError("a PackedLinear cannot be moved or cast; load the model with "
                           "linear_backend='torch' to change its device or dtype")


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` (exact type) in a dtype the kernel runs
    (float32, bfloat16, float16) by a PackedLinear.

    Subclasses of ``nn.Linear`` are left alone: they may change ``forward``. Layers are packed
    one at a time, each unpacked weight dropped before the next is packed (unless something
    else holds it, like an embedding tied to ``lm_head``). The remaining parameters and
    buffers are then copied out of any memory-mapped checkpoint, so that the mapping (which
    holds the unpacked weights too) is released. Returns how many layers were replaced.
    """
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype in DTYPES
               and module.weight.device.type == "cpu"]
    count = len(targets)
    while targets:  # drop each unpacked weight as soon as its packed copy is in place
        name, module = targets.pop()
        model.set_submodule(name, PackedLinear(module))
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

    ``auto`` picks ``cpu`` for a float32, bfloat16 or float16 model on the CPU whenever the
    kernel builds here, at any thread count (it runs on the kernels' own pool; at 2 threads
    it measured faster than torch's threaded GEMM: ``docs/kernels.md``); else ``torch``.

    Raises:
        ValueError: an unknown name, or ``"cpu"`` asked for where it cannot run (the message
            says why).
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {name!r}")
    if name == "torch":
        return "torch", None
    why = unsupported_reason(dtype, device)
    if why is None:
        return "cpu", None
    if name == "cpu":
        raise ValueError(f"linear_backend='cpu' cannot serve this model: {why}")
    return "torch", why
