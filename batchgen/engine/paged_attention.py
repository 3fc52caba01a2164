"""The paged attention function registered with transformers' AttentionInterface.

transformers routes every attention layer of a model loaded with
``attn_implementation="batchgen_paged"`` to :func:`paged_attention_forward`, with RoPE already
applied to the keys. Extra keyword arguments given to ``model(...)`` arrive unchanged, so the
model runner passes an :class:`AttentionMetadata` as ``batchgen_metadata``. No model code is
forked.

The packed batch is one row of ``num_tokens`` tokens: first the decode sequences (one token
each), then the prefill sequences (one chunk each).

:func:`attend` is the one place that attends over the cache. On the CPU path
(``linear_backend="cpu"``) most attention layers do not reach :func:`paged_attention_forward`:
:func:`batchgen.engine.fusion.fuse_model` replaces them, where a probe shows it exact, by a
:class:`~batchgen.engine.fused_attention.FusedAttention` that runs one q/k/v GEMM and RoPE plus
the cache write in one C pass, then calls :func:`attend` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "batchgen_paged"


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what they attend to.

    Attributes:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``.
        slot_mapping: ``[num_tokens]`` int64, the cache slot of each new token.
        num_decode_tokens: the first ``num_decode_tokens`` tokens are one-token decodes.
        decode_block_tables: ``[num_decodes, max_blocks]`` int32.
        decode_context_lens: ``[num_decodes]`` int32, tokens in context incl. the new one.
        prefill_block_tables: ``[num_prefills, max_blocks]`` int32.
        prefill_query_start_loc: ``[num_prefills + 1]``, offsets into the prefill tokens.
        prefill_context_lens: ``[num_prefills]``, tokens in context after this step.
        ops: the attention backend (``batchgen.kernels.get_ops``).
        workspace: scratch buffers the torch backend gathers K/V into, kept by the runner
            across steps (``batchgen.kernels.torch_attention.Workspace``).
        seen: None, or a dict that :func:`paged_attention_forward` fills with each layer's
            :class:`LayerOptions` as the model passed them (the fusion probe reads it).
        pools: None, or each layer's ``(kv_cache[layer, 0], kv_cache[layer, 1])``, made once
            by the cache's owner (:attr:`batchgen.engine.kv_cache.KVCache.pools`): a decode step
            asks for them a few times per layer, and each indexing is a new view.
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor
    ops: Any
    workspace: Any = None
    seen: dict[int, LayerOptions] | None = None
    pools: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V pools, ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        if self.pools is not None:
            return self.pools[layer]
        return self.kv_cache[layer, 0], self.kv_cache[layer, 1]


@dataclass(frozen=True)
class LayerOptions:
    """What one attention layer asks of the paged attention, from HF's attention-interface
    keywords: the softmax ``scale`` (``scaling``; Gemma's ``query_pre_attn_scalar`` arrives as
    it), the ``sliding_window`` (None: a global layer) and the ``logits_soft_cap`` (``softcap``,
    Gemma 2's ``attn_logit_softcapping``; None: none)."""

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    @classmethod
    def from_call(cls, head_size: int, scaling: float | None, kwargs: dict[str, Any]) -> LayerOptions:
        window = kwargs.get("sliding_window")
        cap = kwargs.get("softcap")
        return cls(float(scaling) if scaling is not None else head_size ** -0.5,
                   int(window) if window else None, float(cap) if cap else None)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchgen_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the step's K/V into the paged cache, then attend over it.

    Args:
        query: ``[1, num_heads, num_tokens, head_size]``; key/value ``[1, num_kv_heads,
            num_tokens, head_size]`` (the packed row).

    Returns:
        ``([1, num_tokens, num_heads, head_size], None)``.
    """
    meta = batchgen_metadata
    if meta is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside the batchgen engine "
            "(no batchgen_metadata was passed)"
        )
    # kwargs carry the layer's ``sliding_window`` and ``softcap`` (HF passes both by name).
    options = LayerOptions.from_call(query.shape[-1], scaling, kwargs)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    layer = module.layer_idx
    if meta.seen is not None:
        meta.seen[layer] = options
    meta.ops.reshape_and_cache(k, v, *meta.layer_pools(layer), meta.slot_mapping)
    out = attend(q, layer, options, meta)
    return out.unsqueeze(0), None


def attend(query: torch.Tensor, layer: int, options: LayerOptions, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of the step's queries over layer ``layer``'s paged cache, whose K/V already
    holds the step's tokens: the decode rows through ``meta.ops.paged_decode_attention``, the
    prefill rows through ``paged_prefill_attention``. The one place that attends over the
    cache (:func:`paged_attention_forward` and
    :class:`~batchgen.engine.fused_attention.FusedAttention` both call it).

    Args:
        query: ``[num_tokens, num_heads, head_size]``; may be a strided view (the query heads of
            a fused q/k/v projection).
        options: the layer's scale, sliding window and soft cap.

    Returns:
        ``[num_tokens, num_heads, head_size]``.
    """
    k_cache, v_cache = meta.layer_pools(layer)
    num_decode = meta.num_decode_tokens
    num_tokens = query.shape[0]
    scale = options.scale
    extra = {"workspace": meta.workspace, "sliding_window": options.sliding_window,
             "logits_soft_cap": options.logits_soft_cap}
    if num_decode == num_tokens:
        return meta.ops.paged_decode_attention(
            query, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, **extra)
    if num_decode == 0:
        return meta.ops.paged_prefill_attention(
            query, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_context_lens, scale, **extra)
    out = query.new_empty(query.shape)
    out[:num_decode] = meta.ops.paged_decode_attention(
        query[:num_decode], k_cache, v_cache, meta.decode_block_tables,
        meta.decode_context_lens, scale, **extra)
    out[num_decode:] = meta.ops.paged_prefill_attention(
        query[num_decode:], k_cache, v_cache, meta.prefill_block_tables,
        meta.prefill_query_start_loc, meta.prefill_context_lens, scale, **extra)
    return out


def register() -> str:
    """Register the paged attention with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
