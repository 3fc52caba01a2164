"""FusedAttention: an HF attention layer on the CPU path as one q/k/v GEMM, RoPE and the KV-cache
write in one C pass, then the paged attention.

Why: in a decode step of a small model, HF's attention layer is a chain of narrow ops per layer
(three q/k/v GEMMs, views and transposes, about ten element-wise ops for rotate-half RoPE, the
attention-interface dispatch, two ``index_copy_`` into the cache, a reshape and copy before
``o_proj``); over a few dozen rows their dispatch costs more than their arithmetic, and one
GEMM over the concatenated q/k/v weights runs faster than three narrow ones. Figures are in
``docs/kernels.md``.

A layer with per-head q/k norms (Qwen3's and Gemma 3's ``q_norm``/``k_norm``, applied to each
head before RoPE) keeps its norm modules and runs them on the merged projection's query and key
heads before the C pass. The layer's softmax scale, sliding window and soft cap are the
:class:`~batchgen.engine.paged_attention.LayerOptions` the original layer passed to the attention
interface on the fusion probe.

Which layers become a :class:`FusedAttention` (HF's Llama-like attention whose q/k/v/o, or
Phi-3's one q/k/v, are CPU ``nn.Linear`` or GGUF ``QuantizedLinear``: :func:`attention_candidate`;
and only after a probe shows the fused layer reproduces the original) is decided by
:func:`batchgen.engine.fusion.fuse_model`.

Numerics: the q/k/v layer (:func:`~batchgen.engine.fused_layers.merge_linears`) gives each
output column exactly what the separate packed or quantized q, k and v layers give, RoPE
equals torch's bit for bit (:func:`batchgen.kernels.cpu.fused.rope_and_cache`), and the
attention is the runner's own backend (:func:`batchgen.engine.paged_attention.attend`): a fused
model computes what the unfused one does on the CPU path, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engine import paged_attention
from batchgen.engine.fused_layers import merge_linears, mergeable
from batchgen.kernels.cpu import fused as cpu_fused


class FusedAttention(torch.nn.Module):
    """An HF rotate-half attention layer: one layer for q, k and v, RoPE and the K/V cache
    write in one C pass (:func:`~batchgen.kernels.cpu.fused.rope_and_cache`), the paged
    attention of the runner's backend (:func:`~batchgen.engine.paged_attention.attend`), then
    ``o_proj``.

    Built from the layer it replaces (which it no longer needs): q, k and v merged by
    :func:`~batchgen.engine.fused_layers.merge_linears` (``nn.Linear`` weights concatenated
    and packed; ``QuantizedLinear`` rows concatenated per block type); ``o_proj`` packed, or
    kept quantized.
    """

    def __init__(self, module: torch.nn.Module, options: paged_attention.LayerOptions | None = None) -> None:
        super().__init__()
        self.head_dim = int(module.head_dim)
        self.num_heads, self.num_kv_heads = attention_heads(module)
        self.layer_idx = module.layer_idx
        self.options = options or paged_attention.LayerOptions(float(module.scaling))
        fused = getattr(module, "qkv_proj", None)  # Phi-3: q, k and v in one linear, in that order
        self.qkv_proj = merge_linears([fused] if fused is not None else [module.q_proj, module.k_proj, module.v_proj])
        self._one_qkv = fused is not None
        self.o_proj = merge_linears([module.o_proj])
        norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
        self.qk_norms = all(isinstance(n, torch.nn.Module) for n in norms)
        if self.qk_norms:
            self.q_norm, self.k_norm = norms

    def merged_projections(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        """The merged linear's name and the projections it holds, in order, with their output
        widths: what a LoRA adapter of q/k/v targets in it (:mod:`batchgen.lora.layers`)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self._one_qkv:
            return "qkv_proj", (("qkv_proj", q + 2 * kv),)
        return "qkv_proj", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))

    def extra_repr(self) -> str:
        o = self.options
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, qk_norms={self.qk_norms}, sliding_window={o.sliding_window}, "
                f"logits_soft_cap={o.logits_soft_cap}")

    def _norm_heads(self, qkv: torch.Tensor, num_tokens: int) -> None:
        """The layer's per-head q and k norms on the query and key heads of ``qkv``, in place."""
        heads = qkv.view(num_tokens, -1, self.head_dim)
        h, kv = self.num_heads, self.num_kv_heads
        q = heads[:, :h]
        k = heads[:, h:h + kv]
        q.copy_(self.q_norm(q.contiguous()))
        k.copy_(self.k_norm(k.contiguous()))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        batchgen_metadata: paged_attention.AttentionMetadata | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """HF's attention call (``position_ids``, ``cache``, ``use_cache`` ... arrive in
        ``kwargs`` and are not needed: positions come as ``cos``/``sin``, the cache is the paged
        one, and the window and soft cap are the layer's :attr:`options`).

        Args:
            hidden_states: ``[1, num_tokens, hidden]``, the packed row.
            position_embeddings: ``(cos, sin)``, each ``[1, num_tokens, head_dim]``.
            batchgen_metadata: the step's :class:`~batchgen.engine.paged_attention.AttentionMetadata`.

        Returns:
            ``([1, num_tokens, hidden], None)``.
        """
        meta = batchgen_metadata
        if meta is None or position_embeddings is None:
            raise RuntimeError("FusedAttention runs only inside the batchgen engine "
                               "(batchgen_metadata and position_embeddings are needed)")
        cos, sin = position_embeddings
        qkv = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[-2]
        layer, heads, head_dim = self.layer_idx, self.num_heads, self.head_dim
        if self.qk_norms:
            self._norm_heads(qkv, num_tokens)
        k_cache, v_cache = meta.layer_pools(layer)
        cpu_fused.rope_and_cache(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, heads)
        # the query heads of each row (rope_and_cache checked the rows' unit column stride)
        query = qkv.as_strided((num_tokens, heads, head_dim), (qkv.stride(-2), head_dim, 1))
        if meta.seen is not None:
            meta.seen[layer] = self.options
        out = paged_attention.attend(query, layer, self.options, meta)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], heads * head_dim)), None


def attention_heads(module: torch.nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) of an attention layer :func:`attention_candidate` takes."""
    d = int(module.head_dim)
    if hasattr(module, "qkv_proj"):
        kv = int(module.num_key_value_heads)
        return kv * int(module.num_key_value_groups), kv
    return module.q_proj.out_features // d, module.k_proj.out_features // d


def attention_candidate(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``module`` has the attributes of an HF rotate-half attention layer whose linears
    merge, with shapes that fit: ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (Llama), or one
    ``qkv_proj`` and ``num_key_value_heads``/``num_key_value_groups`` (Phi-3); ``head_dim``,
    ``layer_idx`` and ``scaling`` (whether it *is* one is left to the fusion probe)."""
    head_dim, layer, scaling = (getattr(module, name, None) for name in ("head_dim", "layer_idx", "scaling"))
    if not isinstance(head_dim, int) or not isinstance(layer, int) or not isinstance(scaling, (int, float)):
        return False
    if head_dim <= 0 or head_dim % 2 or not mergeable([getattr(module, "o_proj", None)], dtype):
        return False
    o = module.o_proj
    if hasattr(module, "qkv_proj"):
        kv, groups = getattr(module, "num_key_value_heads", None), getattr(module, "num_key_value_groups", None)
        if not isinstance(kv, int) or not isinstance(groups, int) or kv <= 0 or groups <= 0:
            return False
        qkv = module.qkv_proj
        return (mergeable([qkv], dtype) and qkv.out_features == (groups + 2) * kv * head_dim
                and o.in_features == groups * kv * head_dim)
    q, k, v = (getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if not all(mergeable([p], dtype) for p in (q, k, v)) or not mergeable([q, k, v], dtype):
        return False
    return (k.out_features == v.out_features
            and q.out_features % head_dim == 0 and k.out_features % head_dim == 0
            and (q.out_features // head_dim) % (k.out_features // head_dim) == 0
            and o.in_features == q.out_features)
