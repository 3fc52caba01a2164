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
    gpu_memory_utilization: float | None = None,
) -> int:
    """How many blocks fit the budget.

    ``kv_cache_memory`` is a byte count. Without it: with ``gpu_memory_utilization`` (vLLM's
    setting, GPU only), what is left of that fraction of the GPU's whole memory after what is
    in use now (the loaded model, other processes); else on a GPU ``gpu_memory_fraction`` of
    the memory that is free now, and on CPU 512 MiB.

    Raises:
        ValueError: the budget does not hold a single block, or ``gpu_memory_utilization`` on
            the CPU (the CPU's budget is ``kv_cache_memory``).
    """
    if kv_cache_memory is None and gpu_memory_utilization is not None:
        kv_cache_memory = _utilization_budget(device, gpu_memory_utilization)
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


def check_utilization_device(device: torch.device, utilization: float | None) -> None:
    """Raise ValueError unless ``gpu_memory_utilization`` is unset or ``device`` is a GPU (the
    model runner asks before it loads the weights)."""
    if utilization is not None and device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization={utilization} applies to a GPU; on the CPU the KV "
                         "cache takes kv_cache_memory bytes (default 512 MiB): set kv_cache_memory instead")


def _utilization_budget(device: torch.device, utilization: float) -> int:
    """The KV bytes ``gpu_memory_utilization`` leaves: ``utilization`` of the GPU's memory,
    less what is in use now."""
    check_utilization_device(device, utilization)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * utilization) - used
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {total * utilization / 2**30:.2f} GiB of the "
            f"GPU's {total / 2**30:.2f} GiB, but {used / 2**30:.2f} GiB are in use already (the model "
            "and other processes), which leaves nothing for the KV cache; raise it, or set kv_cache_memory")
    logger.info("gpu_memory_utilization=%s: %.2f GiB for the KV cache (%.2f GiB in use of %.2f GiB)",
                utilization, budget / 2**30, used / 2**30, total / 2**30)
    return budget


class KVCache:
    """The pools. ``kv_cache[layer, 0]`` is layer ``layer``'s K pool, ``[layer, 1]`` its V."""

    def __init__(self, shape: CacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(
            shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size,
            dtype=shape.dtype, device=device,
        )
        # each layer's (K, V) pools as views, made once (AttentionMetadata.pools)
        self.pools = tuple((self.kv_cache[layer, 0], self.kv_cache[layer, 1]) for layer in range(shape.num_layers))
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB (%s, %s)",
            num_blocks, shape.block_size, self.num_bytes / 2**20, shape.dtype, device,
        )

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()
