"""Random-weight GGUF models shaped like the ones people download, for the machine part's file rows.

Each shape is written once, cached under ``$BENCH_MODELS`` (default ``/tmp/bench-models``):

* ``1b``: a Llama-3.2-1B-shaped Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192,
  vocabulary 32000, tied embedding: 1.03 B parameters) in one block type (``Q4_K`` or
  ``Q8_0``), random blocks written straight away (``tests/gguf/tiny_gguf.py``,
  ``oracle=False``);
* ``qwen2.5-1.5b``: Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads / 2 KV heads of 128,
  MLP 8960, vocabulary 151936, q/k/v biases, tied embedding: 1.54 B parameters);
* ``gemma2-2b``: Gemma-2-2B's shape (hidden 2304, 26 layers, 8 heads / 4 KV heads of 256, MLP
  9216, vocabulary 256000, tied embedding, attention and final soft-capping 50 / 30, sliding
  window 4096 on every other layer: 2.61 B parameters).

The last two are written as llama.cpp's converter writes their architecture (the metadata and
tensor names of ``tests/gguf/tiny_arch.py``, the ``gguf`` package's writer), in F16 with
random normal weights (std 0.02; norms 1, Gemma's stored as ``1 + 0``), then quantized by
llama.cpp itself (``llama_model_quantize``) to ``Q4_K_M``: Q4_K with Q6_K for the embedding
and for half the ``attn_v`` / ``ffn_down`` tensors, as a downloaded ``Q4_K_M`` file mixes them.
The F16 file is deleted once quantized.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MODELS = Path(os.environ.get("BENCH_MODELS", "/tmp/bench-models"))
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    """One model shape: its GGUF architecture, HF model type and sizes."""

    arch: str
    hf_model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    config: dict[str, Any] = field(default_factory=dict)

    def kv_bytes_per_token(self, elem: int = 4) -> int:
        """K and V of one token in every layer (batchgen's float32 cache)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


SHAPES: dict[str, Shape] = {
    "1b": Shape("llama", "llama", 2048, 16, 32, 8, 64, 8192, 32000),
    "qwen2.5-1.5b": Shape("qwen2", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936,
                          {"rope_theta": 1_000_000.0, "tie_word_embeddings": True, "max_position_embeddings": 32768}),
    "gemma2-2b": Shape("gemma2", "gemma2", 2304, 26, 8, 4, 256, 9216, 256000,
                       {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                        "max_position_embeddings": 8192}),
}

#: ``--workload`` -> (shape, block type of the file).
WORKLOADS: dict[str, tuple[str, str]] = {
    "1b-q4_k": ("1b", "Q4_K"),
    "1b-q8_0": ("1b", "Q8_0"),
    "qwen2.5-1.5b-q4_k_m": ("qwen2.5-1.5b", "Q4_K_M"),
    "gemma2-2b-q4_k_m": ("gemma2-2b", "Q4_K_M"),
}


def _tests_on_path() -> None:
    folder = str(REPO / "tests" / "gguf")
    if folder not in sys.path:
        sys.path.insert(0, folder)


def model_file(workload: str) -> tuple[Path, Shape]:
    """The file of ``workload`` (a key of :data:`WORKLOADS`), written on first use, and its shape."""
    name, qtype = WORKLOADS[workload]
    shape = SHAPES[name]
    path = MODELS / f"{'llama-1b' if name == '1b' else name}-random-{qtype.lower()}.gguf"
    if path.is_file():
        return path, shape
    MODELS.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    _tests_on_path()
    if name == "1b":
        from tiny_gguf import write_llama_gguf

        write_llama_gguf(tmp, linear_type=qtype, embed_type=qtype, oracle=False, hidden=shape.hidden,
                         intermediate=shape.intermediate, layers=shape.layers, heads=shape.heads,
                         kv_heads=shape.kv_heads, vocab=shape.vocab)
    else:
        f16 = path.with_suffix(".f16")  # kept until quantized: a failed quantization reuses it
        if not f16.is_file():
            write_f16(f16.with_suffix(".f16.tmp"), name, shape)
            f16.with_suffix(".f16.tmp").rename(f16)
        quantize(f16, tmp, qtype)
        f16.unlink()
    tmp.rename(path)
    return path, shape


def hf_config(name: str, shape: Shape):
    """The HF config of ``shape`` (``AutoConfig.for_model`` with its sizes)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(shape.hf_model_type, vocab_size=shape.vocab, hidden_size=shape.hidden,
                                intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                **shape.config)


def write_f16(path: Path, name: str, shape: Shape, seed: int = 0) -> None:
    """``shape`` as llama.cpp's converter writes its architecture, matrices in F16 (random
    normal, std 0.02), norms (1; Gemma's ``1 + w`` with w = 0) and biases (0.02 noise) in F32.
    Tensors are streamed to the file one at a time, so that memory stays at the largest one."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from tiny_arch import write_metadata

    config = hf_config(name, shape)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == shape.arch)
    names = gguf.get_tensor_name_map(arch, shape.layers)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    write_metadata(writer, shape.arch, config, f"random-{name}")
    tensors = []
    for hf_name, param in skeleton.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        dtype = np.float16 if param.dim() == 2 else np.float32
        tensors.append((f"{names.get_name(base)}.{suffix}", tuple(param.shape), dtype))
        writer.add_tensor_info(tensors[-1][0], tensors[-1][1], np.dtype(dtype),
                               int(np.prod(param.shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for gguf_name, dims, dtype in tensors:
        if dtype == np.float32:
            value = (np.ones(dims, np.float32) if gguf_name.endswith("norm.weight")
                     else (0.02 * rng.standard_normal(dims, dtype=np.float32)))
        else:
            value = np.empty(dims, np.float16)
            for start in range(0, dims[0], 4096):  # a float32 chunk at a time
                chunk = rng.standard_normal((min(4096, dims[0] - start), dims[1]), dtype=np.float32)
                value[start:start + len(chunk)] = 0.02 * chunk
        writer.write_tensor_data(value)
    writer.close()


def quantize(source: Path, target: Path, qtype: str, threads: int = 2) -> None:
    """llama.cpp's ``llama_model_quantize`` of ``source`` to ``qtype`` (``Q4_K_M``: the
    ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` mix)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {qtype}) returned {rc}")
