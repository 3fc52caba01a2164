"""Tiny random GGUF files of every architecture row, written as llama.cpp's converter writes them.

:func:`write_arch_gguf` builds a random HF model of one row (``AutoConfig.for_model`` with small
sizes: a 256-wide model, so that every projection's input is a whole number of Q4_K's
256-value blocks), writes it with the ``gguf`` package's writer and tensor-name maps, and
applies what ``convert_hf_to_gguf.py`` applies to that architecture:

- q/k rows permuted for llama.cpp's RoPE layout for the Llama family only (``LlamaModel``);
- Gemma's norms stored as ``1 + w`` (``Gemma2Model`` / ``Gemma3Model``);
- Phi-3's ``qkv_proj`` and ``gate_up_proj`` written whole, as ``attn_qkv`` and ``ffn_up``;
- Llama 3's ``llama3`` RoPE scaling written as the ``rope_freqs`` tensor (its per-frequency
  divisors, computed as the converter computes them);
- the metadata keys each converter class writes (``key_length``, soft-capping, the window).

It returns the HF model holding what the file *means*: the values the ``gguf`` package
de-quantizes the file to, in HF's layout (un-permuted, the norm offset removed). Its sliding
windows are 16 tokens, so that the tests' prompts cross them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tiny_gguf import _permute, add_tokenizer, encode, vocabulary

WINDOW = 16
#: Tokens a file's vocabulary must hold for llama.cpp to load it, by architecture: llama.cpp
#: sets the attributes of Phi-3's ``<unk>``, ``<s>`` and ``</s>`` by name for every model whose
#: ``general.name`` contains "phi3" (``llama-vocab.cpp``), and fails to load one without them
#: ("unordered_map::at"); Phi-3's own SentencePiece vocabulary has them.
ARCH_TOKENS = {"phi3": ("<unk>", "<s>", "</s>")}
_COMMON = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)

#: case -> (GGUF architecture, HF model type, config overrides). ``mistral`` is a Mistral model
#: written as llama.cpp writes it (``llama``, named ``tiny-mistral``: transformers then builds a
#: Mistral model; llama.cpp runs it without a window, as Mistral 7B v0.2+ has none). ``llama3`` is a Llama file
#: with Llama 3's RoPE scaling (an original context of 64, so that its three frequency bands
#: all occur at head size 64); Gemma's head size is 256 so that its ``query_pre_attn_scalar``
#: (256) is the head size, as llama.cpp assumes for all but the 27B models.
CASES: dict[str, tuple[str, str, dict]] = {
    "llama": ("llama", "llama", {}),
    "llama3": ("llama", "llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("llama", "mistral", {"sliding_window": None}),  # written as llama; the name says Mistral
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 64}),
    "gemma2": ("gemma2", "gemma2", {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": WINDOW,
                                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3", "gemma3_text", {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": WINDOW,
                                         "num_hidden_layers": 6}),
    "phi3": ("phi3", "phi3", {"sliding_window": None}),
}


def hf_config(case: str):
    from transformers import AutoConfig

    _arch, model_type, overrides = CASES[case]
    return AutoConfig.for_model(model_type, **{**_COMMON, **overrides})


def _random_model(case: str, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases off their init (1 or 0), so that each one matters
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _rope_freqs(config) -> np.ndarray:
    """The converter's ``rope_freqs``: 1 / HF's ``llama3`` scaling of each frequency."""
    rope = config.rope_parameters
    dim = config.head_dim
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_metadata(writer, arch: str, config, name: str) -> None:
    """The metadata keys llama.cpp's converter writes for ``arch`` (``general.name`` ``name``),
    and the tiny byte-level tokenizer (also used by ``bench/model_shapes.py``)."""
    tokens, merges = vocabulary(config.vocab_size, ARCH_TOKENS.get(arch, ()))
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, tokens, merges)
    writer.add_pad_token_id(0)


def _converted(arch: str, hf_name: str, value: np.ndarray, config) -> tuple[np.ndarray, int | None]:
    """(the tensor as the converter writes it, the head count its rows are permuted by)."""
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
        return _permute(value, heads), heads
    if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
        return value + np.float32(1.0), None
    return value, None


def write_arch_gguf(path: Path, case: str, qtype: str = "F32", *, seed: int = 0,
                    chat_template: str | None = None):
    """Write case ``case`` (a key of :data:`CASES`) to ``path`` with every matrix in ``qtype``
    (norms and biases in F32, as the converter keeps them); return the HF model of the
    file's values."""
    import gguf
    from gguf.quants import dequantize

    arch = CASES[case][0]
    model = _random_model(case, seed)
    config = model.config
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, config, f"tiny-{case}")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    meant = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        value, heads = _converted(arch, hf_name, param.detach().numpy(), config)
        if value.ndim == 1:
            writer.add_tensor(name, value.astype(np.float32))
            stored = value.astype(np.float32)
        else:
            data, kind = encode(value, qtype, rng)
            writer.add_tensor(name, data, raw_dtype=None if qtype in ("F32", "F16") else kind)
            stored = data.astype(np.float32) if qtype in ("F32", "F16") else dequantize(data, kind)
        if heads is not None:  # back to HF's order
            rows = stored.shape[0]
            stored = stored[np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)]
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            stored = stored - np.float32(1.0)
        meant[hf_name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    if case == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(meant, strict=False)  # a tied lm_head follows the embedding
    return model
