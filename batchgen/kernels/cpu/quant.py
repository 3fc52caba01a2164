"""QuantizedLinear: a linear layer whose weight stays in its GGUF blocks (a type of
:data:`~batchgen.kernels.cpu.quant_formats.QUANT_FORMATS`: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
Q6_K), computed by batchgen's int8 dot-product kernel (``quant.c``) on the CPU.

The weight ``W [out_features, in_features]`` arrives as GGUF stores it: each row is
``in_features / block_size`` blocks of ``type_size`` bytes (``gguf.GGML_QUANT_SIZES``). The
module keeps those bytes (rearranged for the kernel, never widened: no float copy of the
weight is resident) and computes ``y = x W^T + b``.

Two paths compute it:

* the kernel (``quant.c``): each row of ``x`` is quantized to int8 blocks, then integer dot
  products (AVX512-VNNI ``vpdpbusd``, AVX-VNNI ``vpdpbusd`` on 256 bits, AVX2
  ``vpmaddubsw``/``vpmaddwd``, or plain C) are
  combined with the blocks' scales in float32, in an order fixed per output element (see
  ``quant.c``'s header): batch-invariant and the same bits on every instruction-set build;
* the torch reference (:func:`reference_linear`): de-quantize (bit for bit as
  ``gguf.quants.dequantize``), then ``F.linear`` in float32. The kernel differs from it by the
  activations' int8 rounding, within a bound the tests state and hold
  (``tests/kernels/quant_arith.py``'s ``activation_error_bound``; ``docs/kernels.md``).

``dequantize`` is this project's own de-quantization (each row's de-quantizer in
``quant_formats.py``), in torch, bit-equal to ``gguf.quants.dequantize`` (the tests check it on
random and real tensors).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from . import c_build
from .quant_formats import QUANT_FORMATS, format_of
from .quant_panels import PANEL, inverse_int32, inverse_permutation, pack_panels, unpack_panels

logger = logging.getLogger(__name__)

def block_size(qtype: GGMLQuantizationType) -> int:
    """Weights per block of ``qtype`` (32, or 256 for the K-quants)."""
    return format_of(qtype).block_size


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` weights in ``qtype``.

    Raises:
        ValueError: ``qtype`` not in :data:`QUANT_FORMATS`, or ``in_features`` not a multiple
            of its block size.
    """
    fmt = format_of(qtype)
    if in_features <= 0 or in_features % fmt.block_size:
        raise ValueError(f"{fmt.name} stores rows in blocks of {fmt.block_size} weights; "
                         f"in_features={in_features} is not a positive multiple of {fmt.block_size}")
    return in_features // fmt.block_size * fmt.type_size


def _check_qtype(qtype) -> GGMLQuantizationType:  # noqa: ANN001 - an int or the enum
    return format_of(qtype).qtype


def _as_bytes(raw) -> torch.Tensor:  # noqa: ANN001 - numpy array or tensor
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if not raw.flags.writeable:  # a read-only map of the file (GGUFReader): copy the bytes
            raw = raw.copy()
        raw = torch.from_numpy(raw)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"quantized weight bytes must be a uint8 numpy array or tensor, got {type(raw).__name__}"
                         f"{'' if not hasattr(raw, 'dtype') else ' of ' + str(raw.dtype)}")
    return raw.reshape(-1).contiguous()


# ---- de-quantization (bit-equal to gguf.quants.dequantize) -------------------------------

def dequantize(raw, qtype, shape: Sequence[int]) -> torch.Tensor:  # noqa: ANN001
    """De-quantize GGUF blocks to a float32 tensor of ``shape`` (the last dimension is the one
    stored in blocks), bit for bit as ``gguf.quants.dequantize``.

    Args:
        raw: uint8 numpy array or tensor holding the blocks (any shape; read as flat bytes).
        qtype: a type of :data:`QUANT_FORMATS` (a ``gguf.GGMLQuantizationType`` or its integer id).
        shape: the weight's shape, e.g. ``(out_features, in_features)``.

    Raises:
        ValueError: an unsupported type, or a byte count that does not match ``shape``.
    """
    qtype = _check_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    data = _as_bytes(raw)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    expected = rows * row_bytes(qtype, shape[-1])
    if data.numel() != expected:
        raise ValueError(f"{qtype.name} weight of shape {shape} needs {expected} bytes, got {data.numel()}")
    fmt = QUANT_FORMATS[qtype]
    return fmt.dequantize_blocks(data.reshape(-1, fmt.type_size)).reshape(shape)


# ---- the kernel's weight layout and library ----------------------------------------------

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what forward takes (computed in float32)

QUANT_SOURCE = Path(__file__).resolve().parent / "quant.c"
# extra compiler flags of each build (after -march=native where the compiler takes it): all this
# CPU has; AVX2 alone (what a CPU with neither AVX-512 nor AVX-VNNI runs); AVX2 with AVX-VNNI
# (what an AVX-VNNI CPU without AVX-512 runs: Alder Lake and later; refused by the library's own
# check where the CPU lacks AVX-VNNI); plain C (no intrinsics at all; the compiler may still
# vectorise the loops). Native picks the same code as these where the CPU has no more.
ISAS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni"),
        "avxvnni": ("-mno-avx512f", "-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
        "plain": ("-DBG_QUANT_PLAIN", "-mno-avx2")}
ISA_NAMES = {3: "avx_vnni", 2: "avx512_vnni", 1: "avx2", 0: "plain C"}


def load_quant(isa: str = "native") -> Any:
    """The compiled quantized-linear library for ``isa`` (a key of :data:`ISAS`),
    built on first use and cached on disk like the other kernels.

    Raises:
        ValueError: an unknown ``isa``.
        c_build.CpuKernelError: no compiler, or it would not build or run here.
    """
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}; got {isa!r}")
    return c_build.load_library("the CPU quantized linear kernel", QUANT_SOURCE, _declare, ISAS[isa],
                               accept=_runs_here, tag="" if isa == "native" else isa)


_runs_here = c_build.runs_here("batchgen_quant_cpu_ok")


def _declare(lib: Any) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.batchgen_quant_isa.restype = i32
    lib.batchgen_quant_isa.argtypes = []
    lib.batchgen_quant_linear.restype = i32
    lib.batchgen_quant_linear.argtypes = [p, i64, i64, i64, p, i32, i64, p, p, i64]
    lib.batchgen_quant_lookup.restype = i32
    lib.batchgen_quant_lookup.argtypes = [p, i32, i64, i64, p, p, i64, p]
    lib.batchgen_quant_rows.restype = None
    lib.batchgen_quant_rows.argtypes = [p, i64, i64, i64, i32, p, p, p]


def kernel_isa(isa: str = "native") -> str:
    """What the ``isa`` build runs on here: ``avx512_vnni``, ``avx_vnni``, ``avx2`` or ``plain C``."""
    return ISA_NAMES[load_quant(isa).batchgen_quant_isa()]


def unsupported_reason() -> str | None:
    """Why the quantized kernel cannot run here (then layers use the torch reference), or None."""
    try:
        load_quant()
    except c_build.CpuKernelError as exc:
        return str(exc)
    return None


# ---- the layer ----------------------------------------------------------------------------

def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference of a quantized layer: ``F.linear`` in float32 on the de-quantized
    ``weight``, returned in ``x``'s dtype."""
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


class QuantizedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` kept in GGUF blocks of a type of :data:`QUANT_FORMATS`.

    Args:
        raw: the weight's GGUF bytes (uint8 numpy array or tensor, read as flat bytes:
            ``out_features`` rows of :func:`row_bytes` each, as a GGUF file stores a
            ``[out_features, in_features]`` weight).
        qtype: its ``gguf.GGMLQuantizationType`` (or the integer id).
        out_features, in_features: the weight's shape.
        bias: optional ``[out_features]`` tensor (kept in float32).
        isa: ``"native"`` (the kernel, with everything this CPU has), ``"avx2"``,
            ``"avxvnni"``, ``"plain"`` (the kernel's other builds, for tests and benchmarks),
            or ``"torch"`` (the reference: de-quantize, then ``F.linear``). ``native`` falls
            back to ``torch``, with one logged line, where the kernel cannot be built.

    The bytes are kept rearranged for the kernel (:func:`pack_panels`, a permutation padded to
    whole panels of 16 rows): no float copy of the weight stays resident.

    ``forward(x)`` takes ``[..., in_features]`` CPU input (float32, bfloat16 or float16) and
    returns ``[..., out_features]`` in ``x``'s dtype (computed in float32, rounded once).
    Inference only.

    Raises:
        ValueError: an unsupported type, a byte count or bias that does not match the shape.
        c_build.CpuKernelError: a build other than ``native`` asked for where it cannot build or run.
    """

    def __init__(self, raw, qtype, out_features: int, in_features: int,  # noqa: ANN001
                 bias: torch.Tensor | None = None, isa: str = "native") -> None:
        super().__init__()
        self.qtype = _check_qtype(qtype)
        self._kernel_id = QUANT_FORMATS[self.qtype].kernel_id  # the row of quant.c's FORMATS_LIST
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.row_bytes = row_bytes(self.qtype, self.in_features)
        data = _as_bytes(raw)
        if data.numel() != self.out_features * self.row_bytes:
            raise ValueError(f"{self.qtype.name} weight [{self.out_features}, {self.in_features}] needs "
                             f"{self.out_features * self.row_bytes} bytes, got {data.numel()}")
        if bias is not None:
            bias = torch.as_tensor(bias).detach().float().reshape(-1).contiguous()
            if bias.numel() != self.out_features:
                raise ValueError(f"bias has {bias.numel()} values; the layer has {self.out_features} outputs")
        if isa not in (*ISAS, "torch"):
            raise ValueError(f"isa must be one of {', '.join((*ISAS, 'torch'))}; got {isa!r}")
        self._lib = None
        if isa != "torch":
            try:
                self._lib = load_quant(isa)
            except c_build.CpuKernelError as exc:
                if isa != "native":
                    raise
                _log_fallback_once(str(exc))
        self.isa = isa if self._lib is not None else "torch"
        packed = pack_panels(data.view(self.out_features, self.row_bytes), self.qtype)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        # the same tensors, read by forward without nn.Module's attribute lookup (0.5 us each,
        # a few hundred calls a decode step); they stay the layer's for its life (_apply refuses)
        self._kernel_tensors = (packed, bias)
        self._what = f"QuantizedLinear({self.in_features} -> {self.out_features}, {self.qtype.name})"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, isa={self.isa}")

    def raw_rows(self) -> torch.Tensor:
        """The weight's GGUF bytes, ``[out_features, row_bytes]`` uint8, as the file stores
        them (a new tensor)."""
        return unpack_panels(self.packed, self.qtype, self.out_features, self.in_features)

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The GGUF bytes of the weight rows ``index`` (``[len(index), row_bytes]`` uint8, as the
        file stores them), read from the panels without unpacking the others: a token embedding
        tied to this layer looks its rows up here, so the two share one copy of the bytes."""
        ts = QUANT_FORMATS[self.qtype].type_size
        nb = self.in_features // block_size(self.qtype)
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        cols = inverse_permutation(self.qtype).view(PANEL, ts)[index % PANEL]                            # [n, ts]
        got = self.packed.view(-1, nb, PANEL * ts)[
            (index // PANEL).view(-1, 1, 1), torch.arange(nb).view(1, -1, 1), cols.view(-1, 1, ts)]
        return got.reshape(index.numel(), nb * ts)

    def dequantized_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight rows ``index`` de-quantized to float32 ``[len(index), in_features]``, bit
        for bit :func:`dequantize` of :meth:`gather_rows` (the kernel's lookup where it runs).

        Raises:
            IndexError: an index outside ``[0, out_features)``.
        """
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1).contiguous()
        if self._lib is None:
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.out_features):
                raise IndexError(f"{self._what}: row index out of range [0, {self.out_features})")
            return dequantize(self.gather_rows(index), self.qtype, (index.numel(), self.in_features))
        y = torch.empty(index.numel(), self.in_features)
        rc = self._lib.batchgen_quant_lookup(self.packed.data_ptr(), self._kernel_id, self.out_features,
                                             self.in_features, inverse_int32(self.qtype).data_ptr(),
                                             index.data_ptr(), index.numel(), y.data_ptr())
        if rc == -4:
            raise IndexError(f"{self._what}: row index out of range [0, {self.out_features})")
        if rc != 0:
            raise RuntimeError(f"{self._what}: the lookup refused its arguments (code {rc})")
        return y

    def dequantized_weight(self) -> torch.Tensor:
        """The weight de-quantized to float32 ``[out_features, in_features]`` (a new tensor)."""
        return dequantize(self.raw_rows(), self.qtype, (self.out_features, self.in_features))

    def _like(self, raw: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> "QuantizedLinear":
        return type(self)(raw, self.qtype, out_features, self.in_features, bias, isa=self.isa)

    @classmethod
    def concat(cls, layers: Sequence["QuantizedLinear"]) -> "QuantizedLinear":
        """One layer whose output is the outputs of ``layers`` side by side (their weight rows
        stacked in order: a packed q/k/v or gate/up GEMM), on the first layer's ``isa``.
        Biases: all or none.

        Raises:
            ValueError: no layers, or layers of different types, input widths or bias presence.
        """
        layers = list(layers)
        if not layers:
            raise ValueError("concat needs at least one layer")
        first = layers[0]
        for layer in layers[1:]:
            if layer.qtype != first.qtype or layer.in_features != first.in_features:
                raise ValueError(f"concat needs one type and input width; got {first.qtype.name} x "
                                 f"{first.in_features} and {layer.qtype.name} x {layer.in_features}")
            if (layer.bias is None) != (first.bias is None):
                raise ValueError("concat needs a bias on every layer or on none")
        raw = torch.cat([layer.raw_rows() for layer in layers], dim=0)
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        return first._like(raw, raw.shape[0], bias)

    def select_rows(self, index) -> "QuantizedLinear":  # noqa: ANN001 - a LongTensor or sequence
        """A layer whose output ``j`` is this layer's output ``index[j]`` (weight rows, and the
        bias, gathered: a RoPE head permutation, a subset). ``index`` may repeat or drop rows.

        Raises:
            ValueError: an index out of range.
        """
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= self.out_features:
            raise ValueError(f"select_rows: indices must lie in [0, {self.out_features}), got "
                             f"{index.numel()} indices" + (f" in [{int(index.min())}, {int(index.max())}]"
                                                           if index.numel() else ""))
        raw = self.raw_rows()[index]
        bias = None if self.bias is None else self.bias[index]
        return self._like(raw, index.numel(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n, dtype = self.in_features, self.out_features, x.dtype
        if x.shape[-1] != k or not x.is_cpu or dtype not in INPUT_DTYPES:
            raise ValueError(f"{self._what} needs float32, bfloat16 or float16 CPU input [..., {k}], "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        lib = self._lib
        if lib is None:
            return reference_linear(x, self.dequantized_weight(), self.bias)
        if dtype is torch.float32 and x.is_contiguous():  # a decode step's rows: no view to build
            rows, ld, m = x, k, x.numel() // k
        else:
            rows = x.reshape(-1, k)
            if rows.dtype is not torch.float32:
                rows = rows.float()
            if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
                rows = rows.contiguous()
            m = rows.shape[0]
            ld = rows.stride(0) if m > 1 else k
        y = torch.empty(m, n)
        if m:
            packed, bias = self._kernel_tensors
            rc = lib.batchgen_quant_linear(rows.data_ptr(), ld, m, k, packed.data_ptr(), self._kernel_id, n,
                                           None if bias is None else bias.data_ptr(), y.data_ptr(), n)
            if rc == -1:
                raise MemoryError(f"{self._what}: no memory for the int8 copy of {m} x {k} inputs")
            if rc != 0:
                raise RuntimeError(f"{self._what}: the kernel refused its arguments (code {rc})")
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], n)
        return y if dtype is torch.float32 else y.to(dtype)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch's signature
        # The weight must stay uint8 bytes on the CPU, and the kernel reads the buffers by
        # address: moving or casting is refused, as for PackedLinear.
        raise RuntimeError("a QuantizedLinear cannot be moved or cast (its weight is GGUF bytes on the CPU)")


_fallback_logged = False


def _log_fallback_once(why: str) -> None:
    global _fallback_logged
    if not _fallback_logged:
        logger.warning("quantized layers run on the torch reference (de-quantize, then matmul): %s",
                       why.splitlines()[0])
        _fallback_logged = True
