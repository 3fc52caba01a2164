"""The ``torch`` attention backend: the paged-attention ops in plain torch (gathers and SDPA).

These functions are the contract of :class:`~batchgen.kernels.ops.AttentionOps`: every kernel of
the ``cpu`` and ``cuda`` backends has a function here with the same signature and meaning, and
the kernel tests hold each kernel to it. :class:`TorchOps` serves them as a backend. The cache
layout they read and write is in :mod:`batchgen.kernels.ops`.

Two per-layer options change what a query sees (both as HF applies them):

- ``sliding_window`` ``W``: the token at position ``p`` attends to positions ``p - W + 1 .. p``
  (``W`` positions, itself included: HF's ``kv_idx > q_idx - sliding_window``); None or 0 is
  full causal attention.
- ``logits_soft_cap`` ``c``: each scaled logit ``x`` becomes ``tanh(x / c) * c`` before the mask
  and the softmax (Gemma 2's ``attn_logit_softcapping``); None or 0 is none. SDPA cannot do
  it, so a soft-capped layer runs HF's eager arithmetic (matmul, scale, cap, softmax in float32,
  matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V into the pools.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        k_cache, v_cache: one layer's pools, ``[num_blocks, block_size, num_kv_heads, head_size]``.
        slot_mapping: ``[num_tokens]`` int64; slot of each token. Every slot is distinct.
    """
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks, K and V, in every layer: ``dst <- src`` for each pair.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``.
        block_mapping: ``[num_pairs, 2]`` int64 of (src, dst). Destinations are distinct and no
            destination is also a source in the same call.
    """
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))


class Workspace:
    """Grow-only scratch buffers that the gathers write into, reused by every layer and step.

    A freshly allocated multi-megabyte tensor is backed by new pages, and touching them for the
    first time (a page fault and a zeroing per 4 KiB) costs more than the gather itself: at 128
    sequences a gather into fresh memory measured 3× slower than into a reused buffer. A view
    handed out by :meth:`get` stays valid only until the next ``get`` of the same name.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``, grown (by at least 1.5×) when too small."""
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = numel if buf is None or buf.dtype != dtype else max(numel, buf.numel() * 3 // 2)
            buf = torch.empty(size, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks_per_seq: int,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's first ``num_blocks_per_seq`` blocks into dense K/V.

    Returns K and V of shape ``[num_seqs, num_blocks_per_seq * block_size, num_kv_heads,
    head_size]``. Positions past a sequence's context length hold garbage and must be masked.
    With a ``workspace`` the results are views of its buffers, valid until the next gather.
    """
    flat = block_tables[:, :num_blocks_per_seq].reshape(-1).long()
    num_seqs = block_tables.shape[0]
    shape = (flat.numel(), *k_cache.shape[1:])
    if workspace is None:
        k = k_cache.index_select(0, flat)
        v = v_cache.index_select(0, flat)
    else:
        k = workspace.get("k", shape, k_cache.dtype, k_cache.device)
        v = workspace.get("v", shape, v_cache.dtype, v_cache.device)
        torch.index_select(k_cache, 0, flat, out=k)
        torch.index_select(v_cache, 0, flat, out=v)
    return (k.view(num_seqs, -1, *k_cache.shape[2:]), v.view(num_seqs, -1, *v_cache.shape[2:]))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: Workspace | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: ``[num_seqs, num_heads, head_size]``; ``num_heads`` is a multiple of
            ``num_kv_heads`` (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32.
        context_lens: ``[num_seqs]`` int32, >= 1; the query token is the last of its context
            and its K/V is already in the cache.
        scale: softmax scale (usually ``head_size ** -0.5``).
        workspace: scratch for the gathered K/V (see :class:`Workspace`); optional.
        sliding_window, logits_soft_cap: see the module docstring.

    Returns:
        ``[num_seqs, num_heads, head_size]`` in the query's dtype.
    """
    num_seqs, num_heads, head_size = query.shape
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    max_len = int(context_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    k, v = _as_query(query, *gather_kv(k_cache, v_cache, block_tables, num_blocks, workspace))
    # [S, KVH, L, D]; SDPA maps query head h to KV head h // group itself (enable_gqa), which
    # gives the same numbers as HF's repeat_kv without materialising the repeated K/V.
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    positions = torch.arange(k.shape[2], device=query.device)
    lens = context_lens.to(query.device).long()[:, None]
    mask = positions[None, :] < lens  # [S, L]
    if sliding_window:
        mask &= positions[None, :] >= lens - sliding_window
    out = _attention(query.unsqueeze(2), k, v, mask[:, None, None, :], scale, num_heads != num_kv_heads,
                     logits_soft_cap)
    return out.squeeze(2)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: Workspace | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over cached prefixes and themselves.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``; they are its
    *last* ``q_len`` tokens, at positions ``context_len - q_len .. context_len - 1``, and their
    K/V is already in the cache. Token at position ``p`` attends to positions ``0..p``.

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32.
        query_start_loc: ``[num_seqs + 1]`` int, cumulative query lengths starting at 0.
        context_lens: ``[num_seqs]`` int, total tokens of each sequence after this step.
        workspace: scratch for the gathered K/V (see :class:`Workspace`); optional.
        sliding_window, logits_soft_cap: see the module docstring (a windowed token at
            position ``p`` attends to ``max(0, p - W + 1) .. p``).

    Returns:
        ``[num_tokens, num_heads, head_size]``.
    """
    num_heads = query.shape[1]
    block_size = k_cache.shape[1]
    gqa = num_heads != k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    # A loop per prefill sequence: prefills are few per step and long; decodes never come here.
    for s, ctx_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        k, v = _as_query(query, *gather_kv(k_cache, v_cache, block_tables[s : s + 1], num_blocks, workspace))
        # 4-D [1, heads, len, D], the shapes HF's own SDPA call uses: CPU SDPA picks its
        # kernel by rank, and only the same kernel gives bit-identical results.
        k = k[:, :ctx_len].permute(0, 2, 1, 3)  # [1, KVH, L, D]
        v = v[:, :ctx_len].permute(0, 2, 1, 3)
        q = query[q0:q1].unsqueeze(0).permute(0, 2, 1, 3)  # [1, H, q_len, D]
        if q_len == ctx_len and not sliding_window and not logits_soft_cap:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            k_pos = torch.arange(ctx_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            o = _attention(q, k, v, mask, scale, gqa, logits_soft_cap)
        out[q0:q1] = o[0].permute(1, 0, 2)
    return out


def _as_query(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K/V in the query's dtype (a 16-bit cache under a float32 query: widened exactly)."""
    if k.dtype == query.dtype:
        return k, v
    return k.to(query.dtype), v.to(query.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               gqa: bool, soft_cap: float | None) -> torch.Tensor:
    """``[.., H, q_len, D]`` queries over ``[.., KVH, L, D]`` keys/values where the boolean
    ``mask`` (broadcast to ``[.., H, q_len, L]``) allows: SDPA, or with a soft cap HF's eager
    arithmetic (``matmul(q, k^T) * scale``, ``tanh(x / c) * c``, masked, softmax in float32)."""
    if not soft_cap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    logits = torch.tanh(logits / soft_cap) * soft_cap
    logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


class TorchOps:
    """The ``torch`` backend's :class:`~batchgen.kernels.ops.AttentionOps`: this module's functions."""

    reshape_and_cache = staticmethod(reshape_and_cache)
    copy_blocks = staticmethod(copy_blocks)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)


_ops = TorchOps()


def get_torch_ops() -> TorchOps:
    """The ``torch`` backend's ops (one shared instance)."""
    return _ops
