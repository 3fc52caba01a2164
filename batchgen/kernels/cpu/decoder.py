"""The ctypes side of ``decoder.c``: a decode step's decoder layers in one C call (float32,
bfloat16 or float16 rows).

``decoder.c`` calls the other kernel libraries' entry points (the quantized and float32 linear
layers, the RMSNorms, act·up, RoPE with the cache write, the paged attention) in the order
the fused Python layers call them, with the same arguments, so the results are their bits.
This module mirrors its structs, builds a layer's :class:`Layer` from the kernel-level parts
(:func:`linear`), and runs the program (:func:`run`). Which model layers are taken, and when,
is :mod:`batchgen.engine.decoder_program`'s.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Sequence

import torch

from batchgen.kernels.cpu import c_build, cpu_attention
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu.linear import PackedLinear
from batchgen.kernels.cpu.quant import QuantizedLinear

SOURCE = Path(__file__).resolve().parent / "decoder.c"
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
MAX_PARTS = 4  # BG_MAX_PARTS
MAX_ROPES = 4  # BG_MAX_ROPES: rotary tables a step may hand over (one per layer type)

#: ``struct bg_part``'s kinds: a float32 PackedLinear, GGUF blocks, a 16-bit PackedLinear.
KIND_F32, KIND_QUANT, KIND_16 = 0, 1, 2
#: decoder.c's AT_* codes (the kernel a failure came from): the four linear layers', then these.
AT_ROPE, AT_ATTENTION, AT_MEMORY = 5, 6, 7
WHERE = {1: "q/k/v projection", 2: "o_proj", 3: "gate/up projection", 4: "down_proj",
         AT_ROPE: "RoPE and the cache write", AT_ATTENTION: "paged attention", AT_MEMORY: "the program's scratch"}


class Entry(ctypes.Structure):
    """``struct bg_entry``: the other libraries' entry points, as addresses."""
    _fields_ = [(name, P) for name in ("quant_linear", "linear_f32", "rms_norm", "add_rms_norm", "gated_mul",
                                       "rope_cache", "attention", "linear_16", "rms_norm_16", "add_rms_norm_16",
                                       "gated_mul_16", "add_16")]


class Part(ctypes.Structure):
    """``struct bg_part``: ``n`` output columns of a linear layer at column ``offset``."""
    _fields_ = [("weight", P), ("bias", P), ("n", I64), ("offset", I64), ("kind", I32), ("qtype", I32)]


class Linear(ctypes.Structure):
    """``struct bg_linear``: a linear layer of up to :data:`MAX_PARTS` parts."""
    _fields_ = [("k", I64), ("n", I64), ("parts", I64), ("part", Part * MAX_PARTS)]


class Layer(ctypes.Structure):
    """``struct bg_layer``: one decoder layer (pre-norm, or Gemma's sandwich)."""
    _fields_ = [("norm1", P), ("norm2", P), ("eps1", F32), ("eps2", F32), ("q_norm", P), ("k_norm", P),
                ("q_eps", F32), ("k_eps", F32), ("attn_out_norm", P), ("mlp_out_norm", P), ("attn_out_eps", F32),
                ("mlp_out_eps", F32), ("act", I32), ("rope", I32),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("heads", I64), ("kv_heads", I64), ("head_dim", I64), ("scale", F32), ("soft_cap", F32),
                ("window", I64), ("k_cache", P), ("v_cache", P), ("num_blocks", I64), ("block_size", I64),
                ("kv_dtype", I32), ("norm_flags", I32)]


class Step(ctypes.Structure):
    """``struct bg_step``: ``m`` decode rows, one per sequence."""
    _fields_ = [("m", I64), ("dtype", I64), ("cos", P * MAX_ROPES), ("sin", P * MAX_ROPES), ("ldc", I64),
                ("lds", I64), ("slots", P),
                ("tables", P), ("lens", P), ("max_blocks", I64)]


def _declare(lib: Any) -> None:
    lib.batchgen_decoder_run.restype = ctypes.c_int
    lib.batchgen_decoder_run.argtypes = [P, P, I64, P, P, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(I64)]
    lib.batchgen_decoder_sizes.restype = I64
    lib.batchgen_decoder_sizes.argtypes = [ctypes.c_int]


def load() -> Any:
    """The compiled program (built on first use, cached on disk like the other kernels); its
    structs checked against the mirrors here.

    Raises:
        c_build.CpuKernelError: no compiler, or it would not build here.
        RuntimeError: the structs do not match (an edit to one side only).
    """
    lib = c_build.load_library("the decoder program", SOURCE, _declare)
    for which, struct in enumerate((Entry, Layer, Step)):
        if lib.batchgen_decoder_sizes(which) != ctypes.sizeof(struct):
            raise RuntimeError(f"decoder.c's {struct.__name__} is {lib.batchgen_decoder_sizes(which)} bytes, "
                               f"its mirror {ctypes.sizeof(struct)}")
    return lib


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def linear(parts: Sequence[torch.nn.Module], kernels: dict, dtype: torch.dtype) -> Linear | None:
    """A :class:`Linear` over ``parts`` (one layer, or a ConcatLinear's parts side by side) for rows
    of ``dtype``: each a :class:`PackedLinear` of that dtype, or (float32 rows) a
    :class:`QuantizedLinear` with its C kernel; None for anything else. ``kernels`` collects the
    parts' entry points by :class:`Entry` field (``quant_linear``, ``linear_f32``,
    ``linear_16``): one of each for the whole program, else None."""
    if not parts or len(parts) > MAX_PARTS:
        return None
    out = Linear(k=parts[0].in_features, n=sum(p.out_features for p in parts), parts=len(parts))
    offset = 0
    for i, part in enumerate(parts):
        if type(part) is QuantizedLinear and part._lib is not None and dtype is torch.float32:
            fn = part._lib.batchgen_quant_linear
            if kernels.setdefault("quant_linear", fn) is not fn:
                return None
            packed, bias = part._kernel_tensors
            out.part[i] = Part(packed.data_ptr(), None if bias is None else bias.data_ptr(), part.out_features,
                               offset, KIND_QUANT, part._kernel_id)
        elif type(part) is PackedLinear and part.dtype is dtype:
            kind, field = (KIND_F32, "linear_f32") if dtype is torch.float32 else (KIND_16, "linear_16")
            if kernels.setdefault(field, part._fn) is not part._fn:
                return None
            out.part[i] = Part(part._packed_ptr, part._bias_ptr, part.out_features, offset, kind, 0)
        else:
            return None
        if part.in_features != out.k:
            return None
        offset += part.out_features
    return out


def entry(kernels: dict, head_size: int, group: int) -> Entry:
    """The entry points: the linear layers' (``kernels``, as :func:`linear` collected them),
    fused.c's ops (its 16-bit ones where the build has them) and the attention kernel of this
    head size and group."""
    ops = cpu_fused.load_fused()
    got = Entry(rms_norm=_address(ops.batchgen_rms_norm_f32), add_rms_norm=_address(ops.batchgen_add_rms_norm_f32),
                gated_mul=_address(ops.batchgen_gated_mul_f32), rope_cache=_address(ops.batchgen_rope_cache),
                attention=_address(cpu_attention.load(head_size, group).batchgen_paged_attention),
                **{field: _address(fn) for field, fn in kernels.items()})
    if ops.batchgen_fused_has_16():
        got.rms_norm_16, got.add_rms_norm_16 = _address(ops.batchgen_rms_norm_16), _address(ops.batchgen_add_rms_norm_16)
        got.gated_mul_16, got.add_16 = _address(ops.batchgen_gated_mul_16), _address(ops.batchgen_add_16)
    return got


def run(lib: Any, ops: Entry, layers: ctypes.Array, step: Step, hidden: torch.Tensor) -> tuple[int, int, int]:
    """Runs ``layers`` over ``hidden`` (``[m, H]`` rows of the step's dtype, contiguous, updated
    in place);
    ``(status, where, layer)``: status 0, or the failing kernel's with :data:`WHERE`'s code and
    the layer's index."""
    where, layer = ctypes.c_int(0), I64(0)
    status = lib.batchgen_decoder_run(ctypes.byref(ops), layers, len(layers), ctypes.byref(step),
                                      hidden.data_ptr(), ctypes.byref(where), ctypes.byref(layer))
    return status, where.value, layer.value
