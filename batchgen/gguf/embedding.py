"""QuantizedEmbedding: a token embedding kept in its GGUF blocks; only looked-up rows are
de-quantized.

A GGUF token embedding (``token_embd.weight``) is a ``[vocab, hidden]`` matrix stored row by
row in blocks along ``hidden``, so one token's row is a run of whole blocks. The embedding
holds it as a :class:`~batchgen.kernels.cpu.quant.QuantizedLinear` (``vocab`` outputs over
``hidden`` inputs): a lookup gathers the requested rows' bytes from it
(``QuantizedLinear.gather_rows``) and de-quantizes them alone
(:func:`batchgen.kernels.cpu.quant.dequantize`, bit for bit the ``gguf`` package's values).
So the resident embedding is the file's bytes, not ``vocab x hidden`` floats, and when the
model ties ``lm_head`` to the embedding, ``lm_head`` *is* that same layer: one copy serves both.
"""

from __future__ import annotations

import torch

from batchgen.kernels.cpu.quant import dequantize

__all__ = ["QuantizedEmbedding"]


class QuantizedEmbedding(torch.nn.Module):
    """``nn.Embedding``'s forward over the GGUF blocks of ``rows``.

    Args:
        rows: a ``QuantizedLinear`` whose weight is the embedding matrix (``out_features`` =
            the vocabulary, ``in_features`` = the embedding width).
        dtype: the dtype of the rows it returns.
        scale: a factor the rows are multiplied by, in ``dtype``, as HF's scaled embeddings
            (Gemma's ``ScaledWordEmbedding``: the square root of the width) do; None for none.
    """

    def __init__(self, rows: torch.nn.Module, dtype: torch.dtype, scale: float | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings = rows.out_features
        self.embedding_dim = rows.in_features
        self.dtype = dtype
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(dtype)

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={float(self.scale):g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}{scale}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        raw = self.rows.gather_rows(flat)
        values = dequantize(raw, self.rows.qtype, (flat.numel(), self.embedding_dim))
        values = values.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)
        return values if self.scale is None else values * self.scale
