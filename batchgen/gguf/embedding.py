"""QuantizedEmbedding: a token embedding kept in its GGUF blocks; only looked-up rows are
de-quantized.

A GGUF token embedding (``token_embd.weight``) is a ``[vocab, hidden]`` matrix stored row by
row in blocks along ``hidden``, so one token's row is a run of whole blocks. The embedding
holds it as a :class:`~batchgen.kernels.cpu.quant.QuantizedLinear` (``vocab`` outputs over
``hidden`` inputs): a lookup de-quantizes the requested rows alone from it
(``QuantizedLinear.dequantized_rows``: the kernel library's lookup, or the rows' bytes gathered
and de-quantized in torch; bit for bit the ``gguf`` package's values either way).
So the resident embedding is the file's bytes, not ``vocab x hidden`` floats, and when the
model ties ``lm_head`` to the embedding, ``lm_head`` *is* that same layer: one copy serves both.
"""

from __future__ import annotations

import torch

__all__ = ["QuantizedEmbedding"]

#: Token ids looked up at once: torch's de-quantization (where the kernel library cannot run)
#: holds several float copies of its rows (52 MiB at peak for 2,048 rows of Qwen2.5-1.5B's
#: 1,536-wide Q6_K embedding, which returns 12 MiB), so a prefill chunk's ids go through a slice
#: at a time. Each row is de-quantized from its own blocks alone: the same values either way.
LOOKUP_ROWS = 256


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
        if flat.numel() <= LOOKUP_ROWS:
            values = self._lookup(flat)
        else:  # a prefill chunk: the de-quantization's temporaries a slice of rows at a time
            values = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
            for start in range(0, flat.numel(), LOOKUP_ROWS):
                values[start:start + LOOKUP_ROWS] = self._lookup(flat[start:start + LOOKUP_ROWS])
        return values.reshape(*input_ids.shape, self.embedding_dim)

    def _lookup(self, flat: torch.Tensor) -> torch.Tensor:
        """The rows of the token ids ``flat``, de-quantized, in ``dtype``, scaled."""
        values = self.rows.dequantized_rows(flat).to(self.dtype)
        return values if self.scale is None else values * self.scale
