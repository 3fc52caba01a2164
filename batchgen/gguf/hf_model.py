"""load_gguf_model: an HF causal LM whose weights come straight from a GGUF file.

The model is built from its HF config (:mod:`batchgen.gguf.metadata`) on the meta device, so no
float copy of the weights is ever made, and each weight is then filled from the file:

- norms and biases become float tensors in ``dtype``;
- each linear layer whose weight is stored in a block type of ``QUANT_FORMATS`` becomes a
  :class:`batchgen.kernels.cpu.quant.QuantizedLinear` over the stored blocks
  (``quantization="gguf"``), or an ``nn.Linear`` of the de-quantized weight (``"none"``);
  a weight in any other type (F16, F32, Q5_1, Q3_K ...) is de-quantized at load, and one logged line
  says which types were;
- the token embedding becomes a :class:`~batchgen.gguf.embedding.QuantizedEmbedding`, and a
  tied ``lm_head`` a ``QuantizedLinear`` over the same blocks.

What each architecture's file means is its row of
:data:`batchgen.gguf.architectures.ARCHITECTURES`: the tensor-name map, and the converter's
transformations this module undoes:

- ``permute_qk`` (the Llama family only): q and k are stored with the rows of each head
  permuted for llama.cpp's RoPE layout; they are put back in HF's order by moving whole rows
  (the blocks run along the input features, so a row is a run of whole blocks and moves
  unchanged);
- ``norm_offset`` (Gemma): the norms are stored as ``1 + w``;
- Llama 3's ``rope_freqs`` tensor divides the RoPE frequencies, as llama.cpp applies it
  (equal, to float rounding, to HF's ``llama3`` RoPE scaling the converter computed it from);
- scaled embeddings (Gemma: rows times the square root of the width) keep their scale.

Buffers computed from the config (RoPE frequencies) are rebuilt on the CPU. The file's tensors
are checked against the model before anything is read (:func:`check_tensors`): a tensor the
model needs that the file lacks, one of another shape, or one the model has no place for is an
error naming the file and the tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.gguf.architectures import ARCHITECTURES, Architecture
from batchgen.gguf.embedding import QuantizedEmbedding
from batchgen.gguf.metadata import open_gguf
from batchgen.gguf.reader import GGUFError, GGUFFile
from batchgen.gguf.tensor_map import check_tensors, is_tied, tensor_names
from batchgen.kernels.cpu.quant import QuantizedLinear
from batchgen.kernels.cpu.quant_formats import QUANT_FORMATS  # the block types kept as stored

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZATIONS", "load_gguf_model"]

QUANTIZATIONS = ("gguf", "none")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's RoPE permutation of a q/k projection:
    ``hf_rows = gguf_rows[index]``."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


class _Filler:
    """Turns the file's tensors into modules and parameters for one model."""

    def __init__(self, gguf: GGUFFile, config: Any, dtype: torch.dtype, keep: bool) -> None:
        self.gguf = gguf
        self.row: Architecture = ARCHITECTURES[gguf.architecture]
        self.config = config
        self.dtype = dtype
        self.keep = keep
        self.dequantized: dict[str, int] = {}
        self.kept: dict[str, int] = {}
        self.raw_cache: dict[str, torch.Tensor] = {}
        self.layers: dict[str, torch.nn.Module] = {}

    def _rows_order(self, name: str) -> np.ndarray | None:
        if not self.row.permute_qk:  # stored in HF's order (every row but the Llama family's)
            return None
        if ".attn_q." in name:
            return _unpermute_rows(self.gguf.tensor(name).data.shape[0], self.config.num_attention_heads)
        if ".attn_k." in name:
            return _unpermute_rows(self.gguf.tensor(name).data.shape[0], self.config.num_key_value_heads)
        return None

    def raw(self, name: str) -> torch.Tensor:
        """The stored blocks of ``name`` as uint8 ``[rows, row_bytes]`` (HF row order), a copy
        in memory of its own (the mapping of the file is not kept alive)."""
        if name not in self.raw_cache:
            data = self.gguf.tensor(name).data
            order = self._rows_order(name)
            array = data[order] if order is not None else np.array(data)
            self.raw_cache[name] = torch.from_numpy(np.ascontiguousarray(array))
            self.gguf.release(name)  # the copy is made: the mapped pages need not stay resident
        return self.raw_cache[name]

    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name`` as floats in ``dtype``, HF's ``shape``."""
        tensor = self.gguf.tensor(name)
        kind = tensor.tensor_type.name
        data = tensor.data
        order = self._rows_order(name)
        if order is not None:
            data = data[order]
        try:
            array = np.asarray(data, dtype=np.float32) if kind in _FLOAT_TYPES and kind != "BF16" \
                else dequantize(np.asarray(data), tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} ({kind}) cannot be de-quantized: {exc}") from None
        if int(np.prod(array.shape)) != int(np.prod(shape)):
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {tuple(array.shape)}, the "
                            f"model expects {shape}")
        if self.row.norm_offset and self.row.is_norm(name):  # stored as offset + w (Gemma: 1 + w)
            array = np.asarray(array, dtype=np.float32) - np.float32(self.row.norm_offset)
        if not array.flags.writeable or not array.flags.c_contiguous:  # a view of the mapped file
            array = np.array(array, copy=True, order="C")
        self.gguf.release(name)
        return torch.from_numpy(array).reshape(shape).to(self.dtype)

    def check_shape(self, name: str, rows: int, cols: int) -> None:
        got = tuple(int(d) for d in reversed(self.gguf.tensor(name).shape.tolist()))
        if got != (rows, cols):
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {got}, the model expects "
                            f"{(rows, cols)}")

    def quantized(self, name: str, out_features: int, in_features: int,
                  bias: torch.Tensor | None = None) -> torch.nn.Module:
        """The ``QuantizedLinear`` of ``name`` (made once: a tied ``lm_head`` and the
        embedding get the same layer)."""
        if name not in self.layers:
            tensor = self.gguf.tensor(name)
            kind = tensor.tensor_type.name
            self.kept[kind] = self.kept.get(kind, 0) + 1
            self.layers[name] = QuantizedLinear(self.raw(name), tensor.tensor_type, out_features,
                                                in_features, bias=bias)
            self.raw_cache.pop(name, None)  # the layer holds the bytes now (in its own layout)
            release_freed_memory()  # its transient copies: the peak stays near the weights' bytes
        return self.layers[name]

    def keeps(self, name: str) -> bool:
        return self.keep and self.gguf.tensor(name).tensor_type in QUANT_FORMATS

    def _count_dequantized(self, name: str) -> None:
        kind = self.gguf.tensor(name).tensor_type.name
        if kind not in _FLOAT_TYPES or self.keep:
            self.dequantized[kind] = self.dequantized.get(kind, 0) + 1

    def linear(self, name: str, module: torch.nn.Linear, bias_name: str | None,
               tied_to: torch.nn.Module | None = None) -> torch.nn.Module:
        self.check_shape(name, module.out_features, module.in_features)
        bias = self.values(bias_name, (module.out_features,)) if bias_name else None
        if self.keeps(name):
            return self.quantized(name, module.out_features, module.in_features, bias)
        layer = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None,
                                device="meta", dtype=self.dtype)
        if isinstance(tied_to, torch.nn.Embedding):  # one float matrix for both, as HF ties them
            layer.weight = tied_to.weight
        else:
            self._count_dequantized(name)
            layer.weight = torch.nn.Parameter(self.values(name, (module.out_features, module.in_features)),
                                              requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)
        return layer

    def embedding(self, name: str, module: torch.nn.Embedding) -> torch.nn.Module:
        """The token embedding: a ``QuantizedEmbedding``, or a float one. A scaled embedding
        (Gemma's ``ScaledWordEmbedding``, rows times ``scalar_embed_scale``) keeps its scale:
        the float one is the model's own module with its weight and scale filled in."""
        self.check_shape(name, module.num_embeddings, module.embedding_dim)
        scale = getattr(module, "scalar_embed_scale", None) if hasattr(module, "embed_scale") else None
        if self.keeps(name):
            rows = self.quantized(name, module.num_embeddings, module.embedding_dim)
            return QuantizedEmbedding(rows, self.dtype, scale=scale)
        self._count_dequantized(name)
        layer = module
        if scale is None:
            layer = torch.nn.Embedding(module.num_embeddings, module.embedding_dim, device="meta",
                                       padding_idx=module.padding_idx, dtype=self.dtype)
        else:
            layer.embed_scale = torch.tensor(scale, dtype=self.dtype)
        layer.weight = torch.nn.Parameter(self.values(name, (module.num_embeddings, module.embedding_dim)),
                                          requires_grad=False)
        return layer


def _fill(model: torch.nn.Module, filler: _Filler, config: Any) -> None:
    """Put each module's weights from the file in place of the meta ones (linear layers and
    the embedding become new modules; norms get their parameters)."""
    tied = is_tied(config, filler.gguf)
    embedding = None
    for module_name, base in tensor_names(model, filler.row, config.num_hidden_layers).items():
        module = model.get_submodule(module_name)
        lm_head_tied = module_name.endswith("lm_head") and tied
        if lm_head_tied:
            base = "token_embd"
        weight = f"{base}.weight"
        if type(module) is torch.nn.Linear:
            bias = f"{base}.bias" if module.bias is not None else None
            model.set_submodule(module_name, filler.linear(weight, module, bias,
                                                           tied_to=embedding if lm_head_tied else None))
        elif isinstance(module, torch.nn.Embedding):  # also Gemma's scaled one
            embedding = filler.embedding(weight, module)
            model.set_submodule(module_name, embedding)
        else:
            for param_name, param in list(module.named_parameters(recurse=False)):
                tensor = f"{base}.{param_name}"
                setattr(module, param_name, torch.nn.Parameter(filler.values(tensor, tuple(param.shape)),
                                                               requires_grad=False))


def _apply_rope_freqs(model: torch.nn.Module, gguf: GGUFFile) -> None:
    """Llama 3's ``rope_freqs`` tensor: llama.cpp divides each RoPE frequency by it (the
    converter computed it from HF's ``llama3`` scaling: 1 for the high frequencies, the factor
    for the low ones, a smooth blend between), so the rotary embedding's frequencies are
    divided by it here; HF's ``llama3`` frequencies are the same to float rounding."""
    if "rope_freqs.weight" not in gguf.tensors:
        return
    factors = torch.from_numpy(np.array(gguf.tensor("rope_freqs.weight").data, dtype=np.float32).reshape(-1))
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            for name in ("inv_freq", "original_inv_freq"):
                current = getattr(module, name, None)
                if isinstance(current, torch.Tensor):
                    if current.shape != factors.shape:
                        raise GGUFError(f"{gguf.path}: tensor 'rope_freqs.weight' has {factors.numel()} values, the "
                                        f"model's RoPE has {current.numel()} frequencies")
                    setattr(module, name, current / factors.to(current.dtype))


def _check_filled(model: torch.nn.Module, gguf: GGUFFile) -> None:
    """Raise naming the first parameter or buffer still on the meta device."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise GGUFError(f"{gguf.path}: the model's {name!r} has no tensor in the file")


def _rebuild_buffers(model: torch.nn.Module, config: Any) -> None:
    """Buffers made on the meta device with the model (RoPE frequencies): build the modules
    that own them again on the CPU, from the config, as the model's constructor did."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)) and not any(True for _ in module.parameters(recurse=False)):
            try:
                fresh = type(module)(config=config)
            except TypeError:
                continue
            model.set_submodule(name, fresh)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``: about 1 ms a
    call), or None without glibc."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the memory freed while loading back to the OS (glibc's ``malloc_trim``): each
    tensor passes through a few transient copies (the bytes read, the panel layout) of up to
    tens of MB, which glibc keeps in its heap once freed; without this a model's resident memory
    stays about 1.2x its weights after the load. A no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_gguf_model(gguf_path: str | Path, config_folder: str | Path, *, dtype: torch.dtype,
                    attn_implementation: str | None = None, quantization: str = "gguf",
                    device: torch.device | str = "cpu") -> torch.nn.Module:
    """Build the HF causal LM of ``config_folder``'s config with weights from ``gguf_path``.

    Args:
        gguf_path: the GGUF file.
        config_folder: a folder with its HF ``config.json`` (:func:`batchgen.gguf.metadata.metadata_folder`).
        dtype: the float dtype of activations, norms and de-quantized weights.
        attn_implementation: passed to the model's constructor.
        quantization: ``"gguf"`` (weights in a type of ``QUANT_FORMATS`` stay as stored) or ``"none"``
            (every weight de-quantized to ``dtype``).
        device: where the model runs; ``quantization="gguf"`` runs on the CPU only.

    Returns the model in eval mode, on ``device``, with ``batchgen_gguf`` set to a dict of what was
    loaded (``kept``, ``dequantized`` counts by type, ``tensor_bytes`` of the file, ``seconds``).

    Raises:
        GGUFError: the file does not parse, is truncated, is of an unsupported architecture,
            or lacks a tensor the model needs (each naming the file, and the tensor).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    device = torch.device(device)
    if quantization == "gguf" and device.type != "cpu":
        raise ValueError(f"quantization gguf keeps the weights in GGUF blocks, which run on the CPU only; "
                         f"on {device} set quantization: none (de-quantize to {str(dtype).removeprefix('torch.')})")
    started = time.perf_counter()
    gguf = open_gguf(Path(gguf_path), Path(config_folder))
    gguf.check_architecture()
    config = AutoConfig.from_pretrained(str(config_folder))
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    check_tensors(gguf, config, model)
    filler = _Filler(gguf, config, dtype, keep=quantization == "gguf")
    _fill(model, filler, config)
    _rebuild_buffers(model, config)
    _apply_rope_freqs(model, gguf)
    _check_filled(model, gguf)
    filler.raw_cache.clear()
    release_freed_memory()
    if device.type != "cpu":
        model.to(device)
    model.eval()
    types = ", ".join(f"{n} {k}" for k, n in sorted(filler.dequantized.items()))
    if filler.dequantized and quantization == "gguf":
        logger.info("%s: %s weight(s) are in types kept only as %s (batchgen computes %s quantized): "
                    "de-quantized at load", gguf.path.name, types, str(dtype).removeprefix("torch."),
                    ", ".join(f.name for f in QUANT_FORMATS.values()))
    seconds = time.perf_counter() - started
    model.batchgen_gguf = {"file": str(gguf.path), "quantization": quantization, "kept": dict(filler.kept),
                           "dequantized": dict(filler.dequantized), "tensor_bytes": gguf.tensor_bytes,
                           "seconds": seconds}
    kept = ", ".join(f"{n} {k}" for k, n in sorted(filler.kept.items()))
    logger.info("loaded %s in %.1f s, quantization %s: %s", gguf.path.name, seconds, quantization,
                f"kept as stored: {kept}" if kept else f"de-quantized to {str(dtype).removeprefix('torch.')}")
    return model
