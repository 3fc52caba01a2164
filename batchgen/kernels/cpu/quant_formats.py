"""QUANT_FORMATS: the GGUF block types batchgen computes quantized, one row each (ggml's
``type_traits`` is the model).

A row holds everything the Python side knows of a type: its ``gguf.GGMLQuantizationType`` (the
GGUF type id, which is also the kernel id ``quant.c``'s ``FORMATS`` table is keyed on), the
block's values and bytes (``gguf.GGML_QUANT_SIZES``), its de-quantizer, and the layout of its
fields that the kernel's panels interleave (``QuantFormat.fields``). ``QuantizedLinear``, the GGUF
loader and the tests read this table and nothing else; a type not in it is de-quantized at
load. Adding a type: docs/kernels.md, "Adding a quant block type".

The de-quantizers are this project's own, in torch, bit-equal to ``gguf.quants.dequantize``
(the same float32 operations in the same order; the tests compare bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["QUANT_FORMATS", "QuantFormat", "format_of"]

Q = GGMLQuantizationType
QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float32 (little-endian half, exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qs & 0x0F, qs >> 4


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] its bits (bit j at j), uint8."""
    j = torch.arange(32)
    return (qh[:, j // 8] >> (j % 8).to(torch.uint8)) & 1


def _q4k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-quants' 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8]) uint8."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


# Each de-quantizer: [n, type_size] uint8 -> [n, block_size] float32, gguf's float operations.

def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    lo, hi = _nibbles(blocks[:, 2:])
    return d * (torch.cat([lo, hi], dim=1).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    lo, hi = _nibbles(blocks[:, 4:])
    return d * torch.cat([lo, hi], dim=1).float() + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    lo, hi = _nibbles(blocks[:, 6:])
    q = torch.cat([lo, hi], dim=1) | (_bits32(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks[:, :2])


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's ``d * sc_j * q - dmin * m_j`` over their 8 sub-blocks of 32."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = _q4k_scale_min(blocks[:, 4:16])
    ds = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * m.float()).reshape(n, 8, 1)
    return (ds * q.float() - dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    lo, hi = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))
    return _k_scaled(blocks, torch.stack([lo, hi], dim=2).reshape(-1, 8, 32))  # sub-block 2p: lo, 2p+1: hi


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    lo, hi = _nibbles(blocks[:, 48:].reshape(-1, 4, 32))
    low = torch.stack([lo, hi], dim=2).reshape(-1, 8, 32)
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return _k_scaled(blocks, low | (high << 4))  # sub-block j's fifth bit: bit j of qh


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks[:, 208:210])
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 128)      # e = 128h + 64s + l
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 2, 128)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, QK_K)


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block type computed quantized.

    ``fields``: the raw block's fields as ``(offset, length, unit)``. In the kernel's panels
    (16 weight rows, see ``quant.c``'s header) unit ``i`` of column ``c`` of a field lands at
    ``offset * 16 + (i * 16 + c) * unit``: the fp16 scales in units of 2 bytes (16 columns'
    scales side by side), everything else in units of 4 (16 columns' 4 bytes: one 64-byte
    vector). The fields with ``unit == 2`` are exactly the block's fp16 values.
    """

    qtype: GGMLQuantizationType
    fields: tuple[tuple[int, int, int], ...]
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def kernel_id(self) -> int:
        """The id ``quant.c``'s ``FORMATS`` rows carry (the GGML type id)."""
        return int(self.qtype)

    @property
    def block_size(self) -> int:
        """Weights per block (32, or 256 for the K-quants)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def halves(self) -> tuple[int, ...]:
        """Offsets of the block's fp16 values (its scales and mins)."""
        return tuple(o for off, length, unit in self.fields if unit == 2 for o in range(off, off + length, 2))


QUANT_FORMATS: dict[GGMLQuantizationType, QuantFormat] = {f.qtype: f for f in (
    QuantFormat(Q.Q4_0, ((0, 2, 2), (2, 16, 4)), _q4_0),
    QuantFormat(Q.Q4_1, ((0, 2, 2), (2, 2, 2), (4, 16, 4)), _q4_1),
    QuantFormat(Q.Q5_0, ((0, 2, 2), (2, 4, 4), (6, 16, 4)), _q5_0),
    QuantFormat(Q.Q8_0, ((0, 2, 2), (2, 32, 4)), _q8_0),
    QuantFormat(Q.Q4_K, ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 4)), _q4_k),
    QuantFormat(Q.Q5_K, ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 32, 4), (48, 128, 4)), _q5_k),
    QuantFormat(Q.Q6_K, ((0, 128, 4), (128, 64, 4), (192, 16, 4), (208, 2, 2)), _q6_k),
)}


def format_of(qtype) -> QuantFormat:  # noqa: ANN001 - an int, a name or the enum
    """The row of ``qtype`` (a ``GGMLQuantizationType``, its integer id or its name).

    Raises:
        ValueError: an unknown type, or one not in :data:`QUANT_FORMATS`.
    """
    try:
        qtype = Q[qtype] if isinstance(qtype, str) else Q(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"unknown GGML quantization type {qtype!r}") from None
    if qtype not in QUANT_FORMATS:
        raise ValueError(f"{qtype.name} is not computed quantized here (supported: "
                         f"{', '.join(f.name for f in QUANT_FORMATS.values())}); de-quantize it at load")
    return QUANT_FORMATS[qtype]
