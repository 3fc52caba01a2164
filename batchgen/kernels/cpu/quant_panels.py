"""The quantized kernel's weight layout (``quant.c``'s header describes it): output rows taken 16
at a time (a panel, zero rows past the end), and within a panel, block by block, each field of
the 16 rows' raw GGUF blocks interleaved unit by unit (``QuantFormat.fields``). A byte
permutation of the file's bytes, never a widening: :func:`pack_panels` and its inverse
:func:`unpack_panels`, and :func:`inverse_permutation`, where each raw byte of one row sits
(:func:`inverse_int32`: the same as the embedding's lookup reads it).
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

from .quant_formats import QUANT_FORMATS

__all__ = ["PANEL", "pack_panels", "unpack_panels", "inverse_permutation", "inverse_int32"]

PANEL = 16  # output columns per panel (quant.c's NR)


@functools.lru_cache(maxsize=None)
def _panel_permutation(qtype: GGMLQuantizationType) -> torch.Tensor:
    """``perm`` with ``panel_block[dst] = columns_block[perm[dst]]``, where ``columns_block`` is
    16 columns' raw blocks one after the other (``c * type_size + byte``)."""
    ts = QUANT_FORMATS[qtype].type_size
    perm = torch.empty(PANEL * ts, dtype=torch.long)
    for off, length, unit in QUANT_FORMATS[qtype].fields:
        i = torch.arange(length // unit).view(-1, 1, 1)
        c = torch.arange(PANEL).view(1, -1, 1)
        t = torch.arange(unit).view(1, 1, -1)
        dst = PANEL * off + (i * PANEL + c) * unit + t
        perm[dst.reshape(-1)] = (c * ts + off + i * unit + t).reshape(-1)
    return perm


@functools.lru_cache(maxsize=None)
def inverse_permutation(qtype: GGMLQuantizationType) -> torch.Tensor:
    """Where byte ``t`` of column ``c``'s raw block sits in a panel's block, at
    ``[c * type_size + t]`` (int64, for torch's indexing)."""
    perm = _panel_permutation(qtype)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return inverse


@functools.lru_cache(maxsize=None)
def inverse_int32(qtype: GGMLQuantizationType) -> torch.Tensor:
    """:func:`inverse_permutation` as ``quant.c``'s lookup reads it: int32, contiguous."""
    return inverse_permutation(qtype).to(torch.int32).contiguous()


def pack_panels(raw_rows: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The kernel's layout of ``raw_rows`` ([N, row_bytes] uint8): a byte permutation, padded
    with zero rows to whole panels; 1-D uint8, ``ceil(N / 16) * 16 * row_bytes`` bytes."""
    n, rb = raw_rows.shape
    ts = QUANT_FORMATS[qtype].type_size
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        raw_rows = torch.cat([raw_rows, raw_rows.new_zeros(panels * PANEL - n, rb)])
    blocks = raw_rows.view(panels, PANEL, rb // ts, ts).transpose(1, 2).reshape(panels, rb // ts, PANEL * ts)
    return blocks[..., _panel_permutation(qtype)].reshape(-1)


def unpack_panels(packed: torch.Tensor, qtype: GGMLQuantizationType, n: int, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_panels`: [n, row_bytes] uint8 raw rows."""
    ts = QUANT_FORMATS[qtype].type_size
    nb = in_features // QUANT_FORMATS[qtype].block_size
    panels = packed.numel() // (PANEL * nb * ts)
    blocks = packed.view(panels, nb, PANEL * ts)[..., inverse_permutation(qtype)].view(panels, nb, PANEL, ts)
    return blocks.transpose(1, 2).reshape(panels * PANEL, nb * ts)[:n]
