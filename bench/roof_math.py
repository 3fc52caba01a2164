"""The roofline's arithmetic (:mod:`bench.roofline`, :mod:`bench.roof_scoring`): the linear
layers' weights a step reads, as a GGUF file stores them, their bytes and operations per step,
a step's place under the roof (:func:`roof_fields`), and under the whole step's roof, attention
in (:func:`step_roof_fields`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# the 2-D weights a step reads through the linear layers (token_embd: only as a tied lm_head)
LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_output.weight",
                   "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_gate_up.weight")


@dataclass(frozen=True)
class Weight:
    """One linear layer's weight: ``n`` outputs x ``k`` inputs, ``nbytes`` as stored."""

    name: str
    n: int
    k: int
    nbytes: int
    lm_head: bool = False


def tensor_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of an ``n x k`` tensor in GGUF type ``qtype`` (rows of ``k`` values in blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if k % block:
        raise ValueError(f"{qtype} rows hold whole blocks of {block} values; got {k}")
    return n * (k // block) * size


def gguf_weights(path: Path | str) -> list[Weight]:
    """The linear layers' weights of a GGUF file, with ``output.weight`` (or, tied, the
    embedding ``token_embd.weight``) as the lm_head."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    out = []
    for t in tensors.values():
        if t.name.endswith(LINEAR_SUFFIXES) or t is head:
            k, n = (int(d) for d in t.shape)  # GGUF lists the row length first
            out.append(Weight(t.name, n, k, tensor_bytes(t.tensor_type.name, n, k), lm_head=t is head))
    return out


def as_float32(weights: list[Weight]) -> list[Weight]:
    """The same layers with float32 weights (4 bytes a value)."""
    return [replace(w, nbytes=4 * w.n * w.k) for w in weights]


def step_bytes(weights: list[Weight]) -> int:
    """Weight bytes one step reads: every linear weight once, whatever the rows."""
    return sum(w.nbytes for w in weights)


def step_ops(weights: list[Weight], rows: int, logit_rows: int | None = None) -> int:
    """Operations of one step's linear layers (a multiply-add is 2): ``rows`` through every
    layer but the lm_head, ``logit_rows`` (default ``rows``: a decode step) through it."""
    head_rows = rows if logit_rows is None else logit_rows
    return sum(2 * (head_rows if w.lm_head else rows) * w.n * w.k for w in weights)


def roof_fields(ops: int, nbytes: int, seconds: float, bandwidth_gbs: float, ceiling_gops: float) -> dict:
    """A step against the roofline: its rates, the roof at its intensity, and the fraction of
    each (see the module docstring)."""
    intensity = ops / nbytes
    gops, gbs = ops / seconds / 1e9, nbytes / seconds / 1e9
    roof = min(ceiling_gops, intensity * bandwidth_gbs)
    return {"intensity_ops_per_byte": intensity, "gops": gops, "weight_gbs": gbs,
            "of_bandwidth": gbs / bandwidth_gbs, "of_ceiling": gops / ceiling_gops,
            "roof_gops": roof, "bound": "bandwidth" if roof < ceiling_gops else "ceiling",
            "of_roof": gops / roof}


def attention_flops(config: Any, keys: int) -> int:
    """QK and PV of query rows that see ``keys`` keys in all (summed over the rows), over every
    query head of every layer of a model of HF ``config`` (a multiply-add is 2)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 4 * text.num_hidden_layers * text.num_attention_heads * head * keys


def causal_keys(tokens: int) -> int:
    """Keys seen in all by the rows of one causal prefill of ``tokens``: 1 + 2 + ... + tokens."""
    return tokens * (tokens + 1) // 2


def step_roof_fields(ops: int, nbytes: int, kv_bytes: float, attn_flops: float, seconds: float,
                     roof: dict, ceiling: str) -> dict:
    """The whole step against the roof: the linear layers' bound (their ops at ``ceiling`` or
    their weights at the read bandwidth, the slower) plus attention's (its K/V reads at the
    bandwidth or its float32 work at the float32 ceiling, the slower: decode reads, prefill
    computes). The two run one after the other in a step, so their times add; the rest of a step
    (norms, sampling, Python) has no roof and counts against it."""
    bw = roof["bandwidth_gbs"] * 1e9
    linear = max(ops / (roof[f"{ceiling}_gops"] * 1e9), nbytes / bw)
    attention = max(kv_bytes / bw, attn_flops / (roof["fp32_gops"] * 1e9))
    return {"step_bound_s": linear + attention, "attention_bound_s": attention,
            "of_step_roof": (linear + attention) / seconds}
