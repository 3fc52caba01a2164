"""ARCHITECTURES: one row per GGUF architecture batchgen loads, and what its file means.

A GGUF file names its architecture (``general.architecture``); llama.cpp's converter
(``convert_hf_to_gguf.py``) writes each architecture's tensors in its own way. A row says
everything the loader and the config need to undo that:

- ``hf_model_type``: the HF model the file builds (transformers reads the metadata into its
  config; :mod:`batchgen.gguf.metadata`);
- the tensor-name map: the ``gguf`` package's own (``get_tensor_name_map`` of the
  architecture), which names HF modules as the converter does (``model.layers.0.self_attn.q_proj``
  -> ``blk.0.attn_q``);
- ``permute_qk``: whether q and k rows are stored permuted for llama.cpp's RoPE layout. The
  converter permutes them for the Llama family only (``LlamaModel.modify_tensors``); Qwen2,
  Qwen3, Gemma 2/3 and Phi-3 are stored in HF's order, so un-permuting them would scramble
  their attention;
- ``norm_offset``: Gemma's RMSNorms compute ``x * (1 + w)``; the converter stores ``1 + w``
  (every tensor named ``*norm``), so the loader subtracts it;
- ``fused``: GGUF tensors that hold several HF projections (Phi-3's ``attn_qkv`` is q, k and v;
  its ``ffn_up`` is gate then up). HF's Phi-3 has the same fused layers, so they load as one;
- ``extra_tensors``: tensors the file may hold beside the model's weights (Llama 3's
  ``rope_freqs``: the per-frequency RoPE divisors of its ``llama3`` scaling);
- ``refused_tensors``: tensors whose meaning batchgen does not build yet: a clear error;
- ``variants``: the layer variants the model needs from the engine (``qkv_bias``,
  ``qk_norm``, ``sliding_window``, ``softcap``, ...), for the docs and the checks;
- ``config``: the HF config keys the metadata holds and transformers' GGUF reader does not
  read (soft-capping, sliding-window layout, per-layer-type RoPE), from the file's metadata.

Adding an architecture is one row here (and, where the converter transforms a tensor in a way
no column says yet, one column): see "Adding a GGUF architecture" in ``docs/gguf.md``.

No torch here, and the ``gguf`` package is imported only when a name map is asked for (it
takes about 0.6 s to import; ``batchgen validate`` reads this table without it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARCHITECTURES", "Architecture", "Metadata", "architecture_of", "tensor_name_map"]

#: ``key -> value`` of the file's metadata with the architecture prefix left off
#: (``"attention.sliding_window"`` reads ``gemma2.attention.sliding_window``); None when absent.
Metadata = Callable[[str], Any]


def _head_dim(meta: Metadata) -> dict[str, Any]:
    """``attention.key_length``, written by the converter for models whose head size is not
    hidden / heads (Qwen3, Gemma); transformers reads it for some architectures only."""
    key_length = meta("attention.key_length")
    return {"head_dim": int(key_length)} if key_length else {}


def _llama_config(meta: Metadata) -> dict[str, Any]:
    """Llama and Mistral files (both build HF's Llama, the same layers, as transformers' reader
    builds them): no sliding window (llama.cpp's ``llama`` runs full attention; a config that
    became Mistral's would default to 4096); linear RoPE scaling as written.
    Llama 3's ``llama3`` scaling is the ``rope_freqs`` tensor, applied at load."""
    updates: dict[str, Any] = {"sliding_window": None}
    if meta("rope.scaling.type") == "linear" and meta("rope.scaling.factor"):
        updates["rope_parameters"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor")),
                                      "rope_theta": float(meta("rope.freq_base") or 10000.0)}
    return updates


def _qwen2_config(meta: Metadata) -> dict[str, Any]:
    """llama.cpp's ``qwen2`` runs full attention in every layer (the converter writes no
    window: Qwen2.5's configs have ``use_sliding_window: false``)."""
    return {"use_sliding_window": False, "sliding_window": None}


def _attention_scalar(meta: Metadata, largest_layers: int) -> int:
    """Gemma's ``query_pre_attn_scalar``, which llama.cpp does not store but derives: hidden /
    heads for the 27B models (identified by their layer count, as llama.cpp does), else the
    head size."""
    if int(meta("block_count")) == largest_layers:
        return int(meta("embedding_length")) // int(meta("attention.head_count"))
    return int(meta("attention.key_length") or int(meta("embedding_length")) // int(meta("attention.head_count")))


def _gemma2_config(meta: Metadata) -> dict[str, Any]:
    """Soft-capping (llama.cpp's defaults, 50 and 30, when absent), the window, alternating
    sliding and global layers (the first sliding), as llama.cpp's ``gemma2`` runs them."""
    layers = int(meta("block_count"))
    return {**_head_dim(meta), "query_pre_attn_scalar": _attention_scalar(meta, 46),
            "attn_logit_softcapping": float(meta("attn_logit_softcapping") or 50.0),
            "final_logit_softcapping": float(meta("final_logit_softcapping") or 30.0),
            "sliding_window": int(meta("attention.sliding_window") or 4096),
            "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]}


def _gemma3_config(meta: Metadata) -> dict[str, Any]:
    """Five sliding layers to each global one (llama.cpp's fixed pattern of 6, unless the file
    stores one), the global RoPE base from the file and the local one llama.cpp fixes at 10,000,
    linear scaling of the global layers' RoPE as written."""
    layers = int(meta("block_count"))
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: sliding or not
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or 6)
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base") or 1_000_000.0)}
    if meta("rope.scaling.type") == "linear" and meta("rope.scaling.factor"):
        full.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    softcap = meta("final_logit_softcapping")
    return {**_head_dim(meta), "query_pre_attn_scalar": _attention_scalar(meta, 62),
            "final_logit_softcapping": float(softcap) if softcap else None, "attn_logit_softcapping": None,
            "sliding_window": int(meta("attention.sliding_window") or 4096), "layer_types": layer_types,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}


def _phi3_config(meta: Metadata) -> dict[str, Any]:
    """The converter writes a window of 0 for Phi-3 models without one (Phi-4)."""
    window = meta("attention.sliding_window")
    updates: dict[str, Any] = {"sliding_window": int(window) if window else None}
    original = meta("rope.scaling.original_context_length")
    if original:
        updates["original_max_position_embeddings"] = int(original)
    return updates


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture (see the module docstring for each column)."""

    name: str
    hf_model_type: str
    permute_qk: bool
    config: Callable[[Metadata], dict[str, Any]]
    norm_offset: float = 0.0
    fused: dict[str, str] = field(default_factory=dict)
    extra_tensors: tuple[str, ...] = ()
    refused_tensors: dict[str, str] = field(default_factory=dict)
    variants: tuple[str, ...] = ()

    def is_norm(self, tensor: str) -> bool:
        """Whether ``tensor`` (a GGUF name) is an RMSNorm weight, which ``norm_offset`` shifts."""
        return tensor.endswith("norm.weight")


ARCHITECTURES: dict[str, Architecture] = {row.name: row for row in (
    Architecture("llama", "llama", permute_qk=True, config=_llama_config,
                 extra_tensors=("rope_freqs.weight",), variants=("rope_freqs",)),
    Architecture("qwen2", "qwen2", permute_qk=False, config=_qwen2_config, variants=("qkv_bias",)),
    Architecture("qwen3", "qwen3", permute_qk=False, config=_head_dim, variants=("qk_norm",)),
    Architecture("gemma2", "gemma2", permute_qk=False, config=_gemma2_config, norm_offset=1.0,
                 variants=("embed_scale", "post_norms", "sliding_window", "softcap")),
    Architecture("gemma3", "gemma3_text", permute_qk=False, config=_gemma3_config, norm_offset=1.0,
                 variants=("embed_scale", "post_norms", "qk_norm", "sliding_window", "rope_per_layer_type")),
    Architecture("phi3", "phi3", permute_qk=False, config=_phi3_config,
                 fused={"attn_qkv": "q, k and v (HF's qkv_proj)", "ffn_up": "gate then up (HF's gate_up_proj)"},
                 refused_tensors={"rope_factors_long.weight": "LongRoPE scaling (Phi-3 128k, Phi-3.5, Phi-4-mini)",
                                  "rope_factors_short.weight": "LongRoPE scaling (Phi-3 128k, Phi-3.5, Phi-4-mini)"},
                 variants=("fused_qkv", "fused_gate_up", "sliding_window")),
)}


def architecture_of(name: str) -> Architecture | None:
    """The row of GGUF architecture ``name``, or None when batchgen does not load it."""
    return ARCHITECTURES.get(name)


def tensor_name_map(row: Architecture, num_layers: int) -> Any:
    """The ``gguf`` package's tensor-name map of ``row`` (``.get_name(hf_module_name)``)."""
    import gguf  # about 0.6 s: only the loader needs the names

    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == row.name)
    return gguf.get_tensor_name_map(arch, num_layers)
