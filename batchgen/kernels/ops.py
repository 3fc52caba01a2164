"""The attention-ops interface that every attention backend implements, and the cache layout.

Three backends implement :class:`AttentionOps`: ``torch`` (:class:`~batchgen.kernels.torch_attention.TorchOps`,
gathers and SDPA: the spec the kernels are pinned to), ``cpu`` (:class:`~batchgen.kernels.cpu.CpuOps`,
C kernels) and ``cuda`` (:class:`~batchgen.kernels.cuda.KernelOps`, CUDA kernels through cupy).
:func:`batchgen.kernels.get_ops` picks one; the engine sees only this interface.

Cache layout (shared by every backend)
--------------------------------------
The whole cache is one tensor ``kv_cache`` of shape
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 of dim 1 is K,
1 is V). ``kv_cache[layer, 0]`` is that layer's K pool, ``[num_blocks, block_size,
num_kv_heads, head_size]``, contiguous. A token's *slot* is ``block_id * block_size + offset``;
``slot_mapping[i]`` is the slot a new token ``i`` writes its K/V to. ``block_tables[s, j]`` is
the physical block holding logical block ``j`` of sequence ``s``; entries past the sequence's
last block are padding and are never read (they may hold any value, conventionally 0).
Keys are stored after RoPE, as the model hands them to attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .torch_attention import Workspace


@runtime_checkable
class AttentionOps(Protocol):
    """The four paged-attention operations. The contracts are
    :mod:`batchgen.kernels.torch_attention`'s functions of the same names, which the kernel tests
    hold every backend to. A backend may ignore ``workspace`` (scratch the torch path gathers
    into); bad indices raise ``ValueError`` where a backend checks them. ``sliding_window`` (a
    layer's window ``W``: position ``p`` sees ``p - W + 1 .. p``) and ``logits_soft_cap``
    (``tanh(x / c) * c`` on the scaled logits) are per-layer options; None or 0 is off."""

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new K/V rows ``[num_tokens, num_kv_heads, head_size]`` into one layer's pools
        at ``slot_mapping``."""

    def copy_blocks(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """Copy whole blocks, K and V, in every layer: ``dst <- src`` for each ``[src, dst]`` row."""

    def paged_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               workspace: Workspace | None = None, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None) -> torch.Tensor:
        """One query token per sequence over its paged context: ``[num_seqs, num_heads, head_size]``."""

    def paged_prefill_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                workspace: Workspace | None = None, sliding_window: int | None = None,
                                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Causal attention of packed new tokens over their cached prefixes and themselves."""
