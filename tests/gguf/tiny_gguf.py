"""Tiny Llama-shaped GGUF files for the tests, written with the ``gguf`` package's writer.

:func:`write_llama_gguf` writes a random HF Llama model's tensors in chosen block types
(``gguf.quants.quantize`` for the types it can quantize; for Q4_K, Q5_K and Q6_K, which it can
only de-quantize, random blocks with small scales), the RoPE permutation of q/k applied as
llama.cpp's converter does, and a small byte-level BPE vocabulary. It returns the fp32 HF
model whose weights are the *de-quantized* file (the oracle: what the file means, per the
``gguf`` package's own ``dequantize``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QTYPE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


#: ``quantization: gguf``: the largest logit error, relative to the largest logit, of the tiny
#: models against their de-quantized fp32 oracle (the int8 rounding of the activations; see
#: docs/gguf.md), and the least share of positions whose top-1 token agrees.
LOGIT_BOUND = 0.05
TOP1_BOUND = 0.9


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    table = dict(zip(printable, chars))
    return [chr(table[b]) for b in range(256)]


def vocabulary(size: int, extra: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """``size`` tokens (3 specials, the 256 bytes, the ``extra`` tokens, then merges
    "Ġ"+letter..., then as many unused ``<|unused{n}|>`` tokens as a larger ``size`` needs) and
    the merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_alphabet() + list(extra)
    merges = []
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    for first in ["Ġ", *letters]:
        for second in letters:
            if len(tokens) >= size:
                break
            if first + second not in tokens:
                merges.append(f"{first} {second}")
                tokens.append(first + second)
    tokens += [f"<|unused{n}|>" for n in range(size - len(tokens))]
    return tokens[:size], merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (HF order -> GGUF order)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``qtype`` whose values are centred on 0 and within about +-0.08 (the
    scales set, the quants random), so that a random model stays well conditioned."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def f16(value: float) -> np.ndarray:
        return np.frombuffer(np.float16(value).tobytes(), np.uint8)

    if qtype in (T.Q8_0, T.Q4_0):  # d (f16), then the quants: d * q, d * (q - 8)
        raw[..., 0:2] = f16(0.0006 if qtype == T.Q8_0 else 0.01)
    elif qtype == T.Q4_1:  # d, m (f16): d * q + m
        raw[..., 0:2] = f16(0.01)
        raw[..., 2:4] = f16(-0.075)
    elif qtype in (T.Q4_K, T.Q5_K):
        # d * sc_j * q - dmin * m_j with sc_j = m_j = v_j (random 6-bit) and dmin = c d, c the
        # middle of q (7.5; 15.5 for Q5_K's 5-bit q): d * v_j * (q - c). The 12 scale bytes pack
        # v_0..v_7 twice, as the K-quants do.
        c = 7.5 if qtype == T.Q4_K else 15.5
        d = 0.00017 if qtype == T.Q4_K else 0.00017 * 7.5 / c
        raw[..., 0:2] = f16(d)
        raw[..., 2:4] = f16(c * d)
        v = rng.integers(1, 64, size=(rows, cols // block, 8), dtype=np.uint8)
        low, high = v[..., :4], v[..., 4:]
        packed = (low & 63) | ((high >> 4) << 6)
        raw[..., 4:8] = packed
        raw[..., 8:12] = packed
        raw[..., 12:16] = (high & 0xF) | ((high & 0xF) << 4)
    elif qtype == T.Q6_K:  # d * scale * (q - 32): int8 scales at 192..208, d (f16) last
        raw[..., 192:208] = rng.integers(-40, 40, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = f16(0.00008)
    else:
        raise AssertionError(qtype)
    return raw.reshape(rows, -1)


def encode(weight: np.ndarray, qtype_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """``weight`` [rows, cols] in ``qtype_name``: (the stored array, the gguf type)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    qtype = T[qtype_name]
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _random_blocks(*weight.shape, qtype, rng), qtype
    if qtype in (T.F32, T.F16):
        return weight.astype(np.float32 if qtype == T.F32 else np.float16), qtype
    return quantize(weight.astype(np.float32), qtype), qtype


def write_llama_gguf(path: Path, *, linear_type: str = "Q8_0", embed_type: str = "Q8_0",
                     output_type: str | None = None, types: dict[str, str] | None = None,
                     hidden: int = 256, intermediate: int = 512, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 320, architecture: str = "llama",
                     seed: int = 0, oracle: bool = True):
    """Write a random Llama GGUF to ``path``; return the fp32 HF model it de-quantizes to.

    ``linear_type`` is every projection's type, ``types`` overrides by tensor name fragment
    (``{"ffn_down": "Q6_K"}``); ``output_type`` None ties ``lm_head`` to the embedding.
    ``oracle=False`` writes random blocks straight away (no HF model is built, nothing is
    returned: for big files whose values do not matter, only their bytes).
    """
    if not oracle:
        return _write_blocks_only(path, linear_type, embed_type, output_type, hidden, intermediate,
                                  layers, heads, kv_heads, vocab, seed)
    import gguf
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=output_type is None, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.05)
    model = LlamaForCausalLM(config).eval()
    writer = _writer(path, architecture, hidden, intermediate, layers, heads, kv_heads, vocab)
    state = {}
    types = dict(types or {})

    def put(name: str, hf_name: str, qtype_name: str, n_head: int | None = None) -> None:
        weight = model.state_dict()[hf_name].detach().numpy()
        if n_head is not None:
            weight = _permute(weight, n_head)
        if weight.ndim == 1:
            writer.add_tensor(name, weight.astype(np.float32))
            return
        for fragment, override in types.items():
            if fragment in name:
                qtype_name = override
        stored, qtype = encode(weight, qtype_name, rng)
        if qtype_name in ("F32", "F16"):
            writer.add_tensor(name, stored)
            value = stored.astype(np.float32)
        else:
            writer.add_tensor(name, stored, raw_dtype=qtype)
            value = dequantize(stored, qtype)
        if n_head is not None:  # back to HF order for the oracle
            rows = value.shape[0]
            index = np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
            value = value[index]
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))

    put("token_embd.weight", "model.embed_tokens.weight", embed_type)
    put("output_norm.weight", "model.norm.weight", "F32")
    if output_type is not None:
        put("output.weight", "lm_head.weight", output_type)
    for i in range(layers):
        pre = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", pre + "input_layernorm.weight", "F32")
        put(f"blk.{i}.ffn_norm.weight", pre + "post_attention_layernorm.weight", "F32")
        put(f"blk.{i}.attn_q.weight", pre + "self_attn.q_proj.weight", linear_type, heads)
        put(f"blk.{i}.attn_k.weight", pre + "self_attn.k_proj.weight", linear_type, kv_heads)
        put(f"blk.{i}.attn_v.weight", pre + "self_attn.v_proj.weight", linear_type)
        put(f"blk.{i}.attn_output.weight", pre + "self_attn.o_proj.weight", linear_type)
        put(f"blk.{i}.ffn_gate.weight", pre + "mlp.gate_proj.weight", linear_type)
        put(f"blk.{i}.ffn_up.weight", pre + "mlp.up_proj.weight", linear_type)
        put(f"blk.{i}.ffn_down.weight", pre + "mlp.down_proj.weight", linear_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name, param in model.state_dict().items():
        if name in state:
            param.copy_(state[name])
        elif name == "lm_head.weight" and output_type is None:
            continue  # tied: the embedding's values
        elif param.dim() == 1:
            continue  # norms: written as float32, loaded as they are
    return model


def add_tokenizer(writer, tokens: list[str], merges: list[str]) -> None:
    """The tiny byte-level BPE tokenizer's metadata (special tokens 0-2: pad, BOS 1, EOS 2), and
    file type 7, as every tiny file carries them."""
    writer.add_file_type(7)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def _writer(path: Path, architecture: str, hidden: int, intermediate: int, layers: int, heads: int,
            kv_heads: int, vocab: int):
    import gguf

    tokens, merges = vocabulary(vocab)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    add_tokenizer(writer, tokens, merges)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    return writer


def _write_blocks_only(path: Path, linear_type: str, embed_type: str, output_type: str | None, hidden: int,
                       intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int) -> None:
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    writer = _writer(path, "llama", hidden, intermediate, layers, heads, kv_heads, vocab)
    head_dim = hidden // heads

    def put(name: str, rows: int, cols: int, qtype_name: str) -> None:
        writer.add_tensor(name, _random_blocks(rows, cols, T[qtype_name], rng), raw_dtype=T[qtype_name])

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    put("token_embd.weight", vocab, hidden, embed_type)
    norm("output_norm.weight")
    if output_type is not None:
        put("output.weight", vocab, hidden, output_type)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        put(f"blk.{i}.attn_q.weight", hidden, hidden, linear_type)
        put(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, linear_type)
        put(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, linear_type)
        put(f"blk.{i}.attn_output.weight", hidden, hidden, linear_type)
        put(f"blk.{i}.ffn_gate.weight", intermediate, hidden, linear_type)
        put(f"blk.{i}.ffn_up.weight", intermediate, hidden, linear_type)
        put(f"blk.{i}.ffn_down.weight", hidden, intermediate, linear_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
