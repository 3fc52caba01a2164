"""KVCache: the K/V pools of every layer, sized from a memory budget.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` in the
model's dtype (see ``batchgen.kernels.ops``). One tensor keeps copy-on-write a single
batched copy over all layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20
DEFAULT_GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class CacheShape:
    """What one block costs: the model's attention geometry and the block size."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem


def num_blocks_for_budget(
    shape: CacheShape,
    device: torch.device,
    kv_cache_memory: int | None,
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
) -> int:
    """How many blocks fit the budget.

    ``kv_cache_memory`` is a byte count. Without it: on a GPU, ``gpu_memory_fraction`` of the
    memory that is free now; on CPU, 512 MiB.

    Raises:
        ValueError: the budget does not hold a single block.
    """
    if kv_cache_memory is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free * gpu_memory_fraction)
        else:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = kv_cache_memory // shape.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory} bytes holds no block; one block of "
            f"{shape.block_size} tokens needs {shape.bytes_per_block} bytes for this model"
        )
    return int(num_blocks)


class KVCache:
    """The pools. ``kv_cache[layer, 0]`` is layer ``layer``'s K pool, ``[layer, 1]`` its V."""

    def __init__(self, shape: CacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(
            shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size,
            dtype=shape.dtype, device=device,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB (%s, %s)",
            num_blocks, shape.block_size, self.num_bytes / 2**20, shape.dtype, device,
        )

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()
