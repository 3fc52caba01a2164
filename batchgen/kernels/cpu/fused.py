"""Fused element-wise CPU ops (``fused.c``): RMSNorm, the gated MLP's act·up, RoPE with the
KV-cache write, greedy picks; float32, and all but the greedy pick in bfloat16 and float16 too;
threaded over rows.

Why: in a decode step of a small model each of these is a chain of torch ops over a few dozen
rows (RMSNorm alone is six), so dispatch and temporaries cost more than the arithmetic. One C
pass per op removes that: on SmolLM2 at 32 sequences the model's non-linear, non-attention ops
went from 22.2 to 17.9 ms of a greedy decode step and sampling from 4.6 to 2.3 ms
(``bench.profile_step``).

- :func:`rms_norm` and :func:`gated_mul` (the gated MLP's ``act(gate) * up``, ``act`` a row of
  :data:`ACTIVATIONS`: SiLU, or GELU's tanh form for Gemma) over the rows of their input;
- :func:`rope_and_cache` rotates the query and key heads of a fused q/k/v projection's output
  in place (HF's rotate-half ``apply_rotary_pos_emb``) and writes the key and value heads into
  the paged cache (``reshape_and_cache``): about a dozen torch ops per attention layer in one
  pass;
- :func:`greedy` returns each row's argmax with its log-probability, in two passes over the
  logits instead of torch's argmax plus logsumexp (five passes and three temporaries);
- :func:`token_logprobs` returns each row's logsumexp and its target's rank, the same two
  passes, for prompt logprobs (scoring: a 2048-token window reduces 2048 rows of the whole
  vocabulary, which torch's compare, max, exp and sum took five passes over).

Their users are the engine's: the fused layers (:mod:`batchgen.engine.fused_layers`,
:mod:`batchgen.engine.fused_attention`), put in a model's place where a probe shows them exact
by :func:`batchgen.engine.fusion.fuse_model`, the sampler's greedy pick and the prompt
logprobs' reduction (:mod:`batchgen.sampling.logprobs`).

Numerics: results equal torch's within float32 rounding (sums in another order; ``exp`` is a
polynomial within about 2e-7 relative of the true value). In bfloat16 and float16 the
arithmetic is float32, rounded to the 16-bit type exactly where the torch modules round
(RMSNorm: the normalised row, then the product with the weight; act·up: the activation, then
the product), so results mostly equal torch's bit for bit and otherwise differ by one unit in the
last place. Each row is computed by one thread in one order: results do not depend on the
other rows nor on the thread count. :func:`rope_and_cache` is exact: torch's products and
sums, each rounded as torch rounds them (float32: no fused multiply-add; 16-bit: each result
rounded to the 16-bit type), so its results equal torch's bit for bit. Greedy output still
matches HF ``generate`` in float32, which the oracle tests check. Used by
``linear_backend="cpu"``, which already needs the C compiler and AVX2.
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path
from typing import Any

import torch

from . import c_build
from .linear import DTYPES, as_rows

logger = logging.getLogger(__name__)

FUSED_SOURCE = Path(__file__).resolve().parent / "fused.c"
_unavailable: str | None = None
_lib: Any = None  # the loaded library: a decode step calls it a few times per layer

#: The gated MLP's activations :func:`gated_mul` runs: name -> (``fused.c``'s ``ACT_*`` code,
#: the torch function it equals within float32 rounding). Gemma's ``gelu_pytorch_tanh`` is
#: ``gelu_tanh``; a model's ``act_fn`` is matched against these by value
#: (:func:`batchgen.engine.fused_layers.activation_of`).
ACTIVATIONS: dict[str, tuple[int, Any]] = {
    "silu": (0, torch.nn.functional.silu),
    "gelu_tanh": (1, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
}


def load_fused() -> Any:
    """The compiled library (built on first use, cached on disk like the other kernels).

    Raises:
        c_build.CpuKernelError: no compiler, or it would not build here.
    """
    global _lib
    if _lib is None:
        _lib = c_build.load_library("the fused CPU ops", FUSED_SOURCE, _declare)
    return _lib


def _declare(lib: Any) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.batchgen_rms_norm_f32.restype = None
    lib.batchgen_rms_norm_f32.argtypes = [p, i64, p, p, i64, i64, i64, f32]
    lib.batchgen_add_rms_norm_f32.restype = None
    lib.batchgen_add_rms_norm_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32]
    lib.batchgen_gated_mul_f32.restype = None
    lib.batchgen_gated_mul_f32.argtypes = [p, i64, p, i64, i64, i64, ctypes.c_int]
    lib.batchgen_greedy_f32.restype = None
    lib.batchgen_greedy_f32.argtypes = [p, i64, i64, i64, p, p, p]
    lib.batchgen_token_logprobs_f32.restype = None
    lib.batchgen_token_logprobs_f32.argtypes = [p, i64, i64, i64, p, p, p]
    lib.batchgen_fused_has_16.restype = ctypes.c_int
    lib.batchgen_rope_cache.restype = ctypes.c_int
    lib.batchgen_rope_cache.argtypes = [p, i64, p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int,
                                        ctypes.c_int]
    if lib.batchgen_fused_has_16():
        lib.batchgen_rms_norm_16.restype = None
        lib.batchgen_rms_norm_16.argtypes = [p, i64, p, p, i64, i64, i64, f32, ctypes.c_int]
        lib.batchgen_add_rms_norm_16.restype = None
        lib.batchgen_add_rms_norm_16.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32, ctypes.c_int]
        lib.batchgen_gated_mul_16.restype = None
        lib.batchgen_gated_mul_16.argtypes = [p, i64, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]


def _lib_for(dtype: torch.dtype, what: str) -> Any:
    """The library, once it is known to run ``what`` in ``dtype`` here.

    Raises:
        ValueError: a dtype the library does not run here.
    """
    lib = load_fused()
    if dtype is not torch.float32:
        if dtype not in DTYPES:
            raise ValueError(f"{what} needs float32, bfloat16 or float16 CPU input, got {dtype}")
        if not lib.batchgen_fused_has_16():
            raise ValueError(f"{what} in {dtype} needs AVX2 and F16C, which this build lacks")
    return lib


def available() -> bool:
    """Whether the library builds and loads here (the answer is remembered)."""
    global _unavailable
    if _unavailable is not None:
        return False
    try:
        load_fused()
    except c_build.CpuKernelError as exc:
        _unavailable = str(exc)
        logger.info("fused CPU ops unavailable: %s", _unavailable.splitlines()[0])
        return False
    return True


def _rows(x: torch.Tensor, width: int, what: str, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """``(rows, row stride, row count)`` of ``x`` for a kernel reading ``[rows, width]`` with unit
    column stride: ``x`` itself where it is contiguous (no view to build), else
    :func:`~batchgen.kernels.cpu.linear.as_rows` (a copy only when needed).

    Raises:
        ValueError, RuntimeError: as :func:`~batchgen.kernels.cpu.linear.as_rows`.
    """
    if x.is_contiguous() and x.dtype is dtype and x.shape[-1] == width and x.is_cpu and not (
            x.requires_grad and torch.is_grad_enabled()):
        return x, width, x.numel() // width if width else 0
    rows = as_rows(x, width, what, dtype)
    return rows, rows.stride(0), rows.shape[0]


#: Or'ed into a 16-bit norm's dtype code: its weight is float32 and scales the float32 row
#: before the one rounding (fused.c's W_F32: Gemma's ``(x * inv) * (1 + w.float())``).
W_F32 = 16


def _check_weight(weight: torch.Tensor, dtype: torch.dtype, what: str) -> tuple[int, int]:
    """A norm's weight: its width and the 16-bit entry points' dtype code for ``dtype`` rows
    (with :data:`W_F32` for a float32 weight of 16-bit rows). The weight is a contiguous 1-D
    tensor of ``dtype``, or of float32 (else ValueError)."""
    if weight.dtype not in (dtype, torch.float32) or weight.dim() != 1 or not weight.is_contiguous():
        also = "" if dtype is torch.float32 else " (or float32)"
        raise ValueError(f"{what} needs a contiguous 1-D {dtype}{also} weight, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if dtype is torch.float32:
        return weight.shape[0], 0
    return weight.shape[0], DTYPES[dtype] | (W_F32 if weight.dtype is torch.float32 else 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x², -1) + eps))`` over the last dim, on the CPU, for float32,
    bfloat16 or float16 ``x`` and ``weight`` of one dtype (16-bit: HF's RMSNorm, which rounds
    the normalised row before the product; see the module docstring), or 16-bit ``x`` and a
    float32 ``weight`` (Gemma's RMSNorm: the product in float32, rounded once).

    Raises:
        ValueError: input of another dtype, device or width; a weight that does not fit.
    """
    dtype = x.dtype
    lib = _lib_for(dtype, "rms_norm")
    n, code = _check_weight(weight, dtype, "rms_norm")
    rows, ld, m = _rows(x, n, "rms_norm", dtype)
    out = torch.empty(m, n, dtype=dtype)
    if m:
        args = (rows.data_ptr(), ld, weight.data_ptr(), out.data_ptr(), n, m, n, eps)
        if dtype is torch.float32:
            lib.batchgen_rms_norm_f32(*args)
        else:
            lib.batchgen_rms_norm_16(*args, code)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, weight, eps))`` with ``s = x + h``: a decoder layer's residual add and the
    norm after it in one pass. ``s`` is torch's ``x + h`` bit for bit (float32; 16-bit: the sum
    in float32, rounded once), the norm :func:`rms_norm`'s bits for ``s``.

    Raises:
        ValueError: ``x`` and ``h`` of different shapes or dtypes, or as :func:`rms_norm`.
    """
    dtype = x.dtype
    lib = _lib_for(dtype, "add_rms_norm")
    n, code = _check_weight(weight, dtype, "add_rms_norm")
    if h.shape != x.shape or h.dtype is not dtype:
        raise ValueError(f"add_rms_norm needs x and h of one shape and dtype, got {x.dtype} {tuple(x.shape)} "
                         f"and {h.dtype} {tuple(h.shape)}")
    xs, ldx, m = _rows(x, n, "add_rms_norm", dtype)
    hs, ldh, _ = _rows(h, n, "add_rms_norm", dtype)
    total, out = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
    if m:
        args = (xs.data_ptr(), ldx, hs.data_ptr(), ldh, weight.data_ptr(), total.data_ptr(), out.data_ptr(), m, n, eps)
        if dtype is torch.float32:
            lib.batchgen_add_rms_norm_f32(*args)
        else:
            lib.batchgen_add_rms_norm_16(*args, code)
    return total.view(x.shape), out.view(x.shape)


def gated_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(g) * u`` where ``gate_up = cat([g, u], -1)``: ``[..., 2n] -> [..., n]``, ``act`` the
    :data:`ACTIVATIONS` row named ``activation``, for float32, bfloat16 or float16 on the CPU
    (16-bit: torch's roundings; see the module docstring).

    Raises:
        ValueError: input of another dtype or device, an odd last dim, or an unknown activation.
    """
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gated_mul needs an even last dim (gate, then up), got {width}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    dtype = gate_up.dtype
    lib = _lib_for(dtype, "gated_mul")
    rows, ld, m = _rows(gate_up, width, "gated_mul", dtype)
    n = width // 2
    out = torch.empty((*gate_up.shape[:-1], n), dtype=dtype)
    if m:
        args = (rows.data_ptr(), ld, out.data_ptr(), n, m, n)
        code = ACTIVATIONS[activation][0]
        if dtype is torch.float32:
            lib.batchgen_gated_mul_f32(*args, code)
        else:
            lib.batchgen_gated_mul_16(*args, DTYPES[dtype], code)
    return out


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> None:
    """Rotate-half RoPE of a fused projection's query and key heads, in place, and the key and
    value heads written into the paged cache: HF's ``apply_rotary_pos_emb`` followed by
    ``reshape_and_cache``, in one C pass (float32, bfloat16 or float16; bit for bit what torch
    computes, see ``rope_and_cache`` in tests/kernels/cpu_reference.py).

    Args:
        qkv: ``[..., num_tokens, (num_heads + 2 * num_kv_heads) * head_size]``, rows of unit
            column stride (the output of the fused q/k/v projection): query heads, then key
            heads, then value heads. The query and key heads are rotated in place.
        cos, sin: ``[..., num_tokens, head_size]`` (HF's ``position_embeddings``), ``qkv``'s dtype.
        k_cache, v_cache: one layer's pools, ``[num_blocks, block_size, num_kv_heads,
            head_size]``, contiguous, ``qkv``'s dtype (or bfloat16 / float16 under float32 rows:
            the rows rounded to it, as ``.to()`` rounds).
        slot_mapping: ``[num_tokens]`` int64, distinct cache slots.

    Raises:
        ValueError: shapes, dtypes or layouts outside the contract, or a slot outside the cache
            (then nothing is written).
    """
    dtype = qkv.dtype
    lib = _lib_for(dtype, "rope_and_cache")
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.shape[-1] != width or qkv.stride(-1) != 1 or not qkv.is_cpu:
        raise ValueError(f"rope_and_cache: qkv must be a CPU [..., {width}] tensor of unit column stride "
                         f"({num_heads} query and {num_kv_heads} key/value heads of {head_size}), "
                         f"got {tuple(qkv.shape)} with strides {qkv.stride()}")
    rows = qkv.view(-1, width)  # a view, so that the rotation lands in qkv
    m = rows.shape[0]
    if head_size % 2 or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"rope_and_cache: k_cache and v_cache must be contiguous, of one shape and an even "
                         f"head size, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    kv_dtype = k_cache.dtype
    if not (kv_dtype is dtype or (dtype is torch.float32 and kv_dtype in (torch.bfloat16, torch.float16))) or (
            v_cache.dtype is not kv_dtype or not k_cache.is_cpu or not v_cache.is_cpu):
        raise ValueError(f"rope_and_cache: the caches must be CPU tensors of one dtype, {dtype} (or a 16-bit one "
                         f"under float32 rows), got {k_cache.dtype}, {v_cache.dtype}")
    if kv_dtype is not dtype:
        _lib_for(kv_dtype, "rope_and_cache")  # a 16-bit cache needs the build's 16-bit conversions
    if slot_mapping.dtype is not torch.int64 or slot_mapping.shape != (m,) or not slot_mapping.is_cpu:
        raise ValueError(f"rope_and_cache: slot_mapping must be a CPU int64 [{m}] tensor, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    cos_rows, ldc, cos_m = _rows(cos, head_size, "rope_and_cache (cos)", dtype)
    sin_rows, lds, sin_m = _rows(sin, head_size, "rope_and_cache (sin)", dtype)
    if cos_m != m or sin_m != m:
        raise ValueError(f"rope_and_cache: cos and sin must hold {m} rows of {head_size}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if not m:
        return
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    status = lib.batchgen_rope_cache(
        rows.data_ptr(), rows.stride(0), cos_rows.data_ptr(), ldc, sin_rows.data_ptr(), lds,
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        num_blocks * block_size, m, num_heads, num_kv_heads, head_size, DTYPES[dtype], DTYPES[kv_dtype])
    if status:
        raise ValueError(f"rope_and_cache: slots must lie in [0, {num_blocks * block_size})")


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Each row's argmax (first index on ties, as ``torch.argmax``) and its log-probability
    ``max - logsumexp(row)``, for float32 CPU ``[rows, vocab]`` logits. The difference is taken
    in double, from the float32 max and the float32 :func:`logsumexp`, so a sampler that
    computes ``double(x) - double(logsumexp(row))`` gets the same bits for the same token.

    Returns None, so that the caller takes torch's path, when the library is unavailable,
    the logits are not float32 on the CPU, or a row holds NaN or infinities (torch's NaN and
    infinity rules then apply, and an all ``-inf`` row gets the caller's error).
    """
    result = _greedy_pass(logits)
    if result is None:
        return None
    ids, maxes, lse = result
    top = maxes.tolist()
    norm = lse.tolist()
    if not all(math.isfinite(a) and math.isfinite(b) for a, b in zip(top, norm)):
        return None
    return ids.tolist(), [a - b for a, b in zip(top, norm)]


def logsumexp(logits: torch.Tensor) -> torch.Tensor | None:
    """``log(sum(exp(row)))`` of each row of float32 CPU ``[rows, vocab]`` logits, the value
    :func:`greedy` uses (float32; NaN or infinite for rows that hold NaN or infinities).

    A row's value does not depend on the other rows. None when the library is unavailable or
    the logits are not float32 on the CPU.
    """
    result = _greedy_pass(logits)
    return None if result is None else result[2]


def _greedy_pass(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(argmax, max, logsumexp)`` of each row from ``batchgen_greedy_f32``, or None when it
    cannot run here."""
    if (logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 2
            or not available()):
        return None
    m, n = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(m, dtype=torch.int64)
    maxes = torch.empty(m, dtype=torch.float32)
    lse = torch.empty(m, dtype=torch.float32)
    if m:
        load_fused().batchgen_greedy_f32(logits.data_ptr(), logits.stride(0), m, n, ids.data_ptr(),
                                         maxes.data_ptr(), lse.data_ptr())
    return ids, maxes, lse


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(logsumexp, rank)`` of each row of float32 CPU ``[rows, vocab]`` logits for its target
    id ``targets[i]``: the logsumexp :func:`logsumexp` gives (the same bits; float32, not finite
    for a row holding NaN or infinities) and ``1 + #{v : row[v] > row[target]}`` (int64), in
    two passes over each row and no temporary the size of the logits. A row's values do not
    depend on the other rows nor on the thread count. None when the library is unavailable or
    the logits are not float32 on the CPU.

    Raises:
        ValueError: ``targets`` is not ``[rows]`` or holds an id outside ``[0, vocab)``.
    """
    if (logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 2
            or not available()):
        return None
    m, n = logits.shape
    targets = targets.to(device="cpu", dtype=torch.int64).contiguous()
    if targets.shape != (m,) or (m and not 0 <= int(targets.min()) <= int(targets.max()) < n):
        raise ValueError(f"targets must be [{m}] ids in [0, {n}), got shape {tuple(targets.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lse = torch.empty(m, dtype=torch.float32)
    ranks = torch.empty(m, dtype=torch.int64)
    if m:
        load_fused().batchgen_token_logprobs_f32(logits.data_ptr(), logits.stride(0), m, n, targets.data_ptr(),
                                                 lse.data_ptr(), ranks.data_ptr())
    return lse, ranks


def supported(dtype: torch.dtype) -> bool:
    """Whether the library runs ``dtype`` here (float32; bfloat16 and float16 with AVX2, F16C)."""
    return dtype is torch.float32 or (dtype in DTYPES and bool(load_fused().batchgen_fused_has_16()))
