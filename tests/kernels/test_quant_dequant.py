"""De-quantization of GGUF blocks (``kernels/cpu/quant.py``) against the ``gguf`` package's own
``dequantize``, bit for bit: random tensors quantized by ``gguf.quants.quantize`` (Q4_0, Q4_1,
Q5_0, Q8_0), random valid blocks for every type (the K-quants only so: ``gguf`` has no
quantizer for them), and every
tensor of the embedded SmolLM2 GGUF in a supported type (Q4_1 and Q8_0). And the
``QuantizedLinear`` container: concat, select_rows and its errors.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from batchgen.kernels.cpu import quant
from batchgen.kernels.cpu.quant import QuantizedLinear
from batchgen.kernels.cpu.quant_formats import QUANT_FORMATS

#: what gguf.quants.quantize can write (it only de-quantizes the K-quants)
GGUF_QUANTIZES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)


def random_blocks(qtype: Q, rows: int, in_features: int, seed: int) -> np.ndarray:
    """Random valid GGUF bytes ``[rows, row_bytes]``: random quants, scales and mins, with
    every fp16 scale a finite number of a weight's magnitude."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    n = rows * in_features // bs
    blocks = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for offset in QUANT_FORMATS[qtype].halves:
        blocks[:, offset:offset + 2] = rng.normal(0, 0.02, size=(n, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized(qtype: Q, rows: int, in_features: int, seed: int) -> np.ndarray:
    """GGUF bytes of a random weight: quantized by ``gguf`` where it can, else random blocks."""
    if qtype in GGUF_QUANTIZES:
        w = np.random.default_rng(seed).normal(0, 0.5, size=(rows, in_features)).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    return random_blocks(qtype, rows, in_features, seed)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", QUANT_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("source", ["quantize", "random_blocks"])
def test_dequantize_equals_gguf_bit_for_bit(qtype: Q, source: str) -> None:
    rows, k = 48, 4 * quant.block_size(qtype)
    if source == "quantize":
        raw = quantized(qtype, rows, k, seed=int(qtype))
    else:
        raw = random_blocks(qtype, rows, k, seed=int(qtype) + 100)
    ours = quant.dequantize(raw, qtype, (rows, k))
    assert ours.dtype == torch.float32 and ours.shape == (rows, k)
    assert np.array_equal(_bits(ours.numpy()), _bits(gguf.quants.dequantize(raw, qtype)))
    # the same bytes as a tensor, and as a layer's weight
    assert torch.equal(quant.dequantize(torch.from_numpy(raw), int(qtype), (rows, k)), ours)
    assert torch.equal(QuantizedLinear(raw, qtype, rows, k).dequantized_weight(), ours)


def _embedded_reader() -> gguf.GGUFReader:
    from batchgen import model_resolver as models
    try:
        path = models._embedded_gguf_path(models.EMBEDDED_MODELS[models.DEFAULT_MODEL])
    except models.ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return gguf.GGUFReader(path)


def test_dequantize_equals_gguf_on_the_embedded_file() -> None:
    reader = _embedded_reader()
    seen: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in QUANT_FORMATS:
            continue
        shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
        if tensor.tensor_type == Q.Q8_0:  # the 49,152 x 576 embedding: check a slice of rows
            data = np.asarray(tensor.data)[:2048]
            shape = (2048, shape[1])
        else:
            data = np.asarray(tensor.data)
        ours = quant.dequantize(data, tensor.tensor_type, shape)
        assert np.array_equal(_bits(ours.numpy()), _bits(gguf.quants.dequantize(data, tensor.tensor_type))), tensor.name
        seen[tensor.tensor_type.name] = seen.get(tensor.tensor_type.name, 0) + 1
    assert seen.get("Q4_1", 0) >= 200 and seen.get("Q8_0", 0) >= 1, seen


def test_concat_and_select_rows_move_whole_rows() -> None:
    qtype, k = Q.Q4_1, 64
    a_raw, b_raw = quantized(qtype, 40, k, 1), quantized(qtype, 24, k, 2)
    a = QuantizedLinear(a_raw, qtype, 40, k, bias=torch.arange(40.0))
    b = QuantizedLinear(b_raw, qtype, 24, k, bias=-torch.arange(24.0))
    both = QuantizedLinear.concat([a, b])
    assert (both.out_features, both.in_features) == (64, k)
    assert torch.equal(both.dequantized_weight(), torch.cat([a.dequantized_weight(), b.dequantized_weight()]))
    assert torch.equal(both.bias, torch.cat([a.bias, b.bias]))
    index = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:50]
    sel = both.select_rows(index)
    assert torch.equal(sel.dequantized_weight(), both.dequantized_weight()[index])
    assert torch.equal(sel.bias, both.bias[index])
    x = torch.randn(3, k)
    assert torch.equal(sel.raw_rows(), both.raw_rows()[index])
    assert sel(x).shape == (3, 50)


def test_bad_input_is_a_clear_error() -> None:
    raw = quantized(Q.Q4_0, 4, 64, 0)
    with pytest.raises(ValueError, match="Q5_1 is not computed quantized here"):
        QuantizedLinear(raw, Q.Q5_1, 4, 64)
    with pytest.raises(ValueError, match="unknown GGML quantization type 99"):
        QuantizedLinear(raw, 99, 4, 64)
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        QuantizedLinear(raw, Q.Q4_0, 4, 48)
    with pytest.raises(ValueError, match="needs 144 bytes, got 72"):
        QuantizedLinear(raw[:2], Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="bias has 3 values"):
        QuantizedLinear(raw, Q.Q4_0, 4, 64, bias=torch.zeros(3))
    layer = QuantizedLinear(raw, Q.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="indices must lie in"):
        layer.select_rows([0, 4])
    with pytest.raises(ValueError, match="one type and input width"):
        QuantizedLinear.concat([layer, QuantizedLinear(quantized(Q.Q8_0, 4, 64, 0), Q.Q8_0, 4, 64)])
    with pytest.raises(ValueError, match=r"CPU input \[..., 64\], got torch.float32 \(2, 32\)"):
        layer(torch.zeros(2, 32))
