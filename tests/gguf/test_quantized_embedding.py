"""QuantizedEmbedding (``gguf/embedding.py``): a lookup gives the de-quantized rows of its ids,
scaled, in its dtype, the same bits whether the ids go through at once or a slice at a time."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchgen.gguf import embedding
from batchgen.gguf.embedding import QuantizedEmbedding
from batchgen.kernels.cpu import quant
from batchgen.kernels.cpu.quant import QuantizedLinear

VOCAB, WIDTH = 80, 64


def _table() -> tuple[QuantizedLinear, torch.Tensor]:
    w = np.random.default_rng(0).normal(0, 0.5, size=(VOCAB, WIDTH)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q8_0)
    return QuantizedLinear(raw, Q.Q8_0, VOCAB, WIDTH), quant.dequantize(raw, Q.Q8_0, (VOCAB, WIDTH))


@pytest.mark.parametrize("lookup_rows", [7, 16, 10_000])
def test_a_lookup_gives_the_rows_of_its_ids_however_it_is_sliced(monkeypatch, lookup_rows) -> None:
    """45 ids in a [3, 15] batch, looked up 7 or 16 at a time or all at once: the rows of the
    de-quantized table, times the scale, bit for bit."""
    monkeypatch.setattr(embedding, "LOOKUP_ROWS", lookup_rows)
    rows, table = _table()
    ids = torch.randint(0, VOCAB, (3, 15), generator=torch.Generator().manual_seed(1))
    scale = torch.tensor(8.0 ** 0.5)
    got = QuantizedEmbedding(rows, torch.float32, scale=float(scale))(ids)
    assert got.shape == (3, 15, WIDTH) and got.dtype == torch.float32
    assert torch.equal(got, table[ids] * scale)
    plain = QuantizedEmbedding(rows, torch.bfloat16)(ids)
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, table[ids].to(torch.bfloat16))
