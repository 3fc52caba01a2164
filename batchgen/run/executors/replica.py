"""One engine replica: the body of a Ray actor (``ray.remote`` is applied by the driver), and
how the driver adds up the replicas' engine counters.

This module imports neither torch nor Ray at import time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from batchgen.engine.config import EngineConfig
from batchgen.quiet import quiet_libraries
from batchgen.run.executors import stats_dict, thread_figures
from batchgen.run.executors.cluster import ray_location

__all__ = ["CALL_MAX_SECONDS", "COUNTERS", "EngineReplica", "aggregate_stats", "build_engine"]

#: A replica call returns as soon as a request finishes, or after this long (progress ticks).
CALL_MAX_SECONDS = 0.5


def build_engine(engine: EngineConfig) -> Any:
    """The default engine factory of a replica: an ``LLM``."""
    # deferred: `LLM` imports torch; the run layer stays torch-free
    from batchgen import LLM

    return LLM(config=engine)


class EngineReplica:
    """One engine replica: the body of a Ray actor (``ray.remote`` is applied by the driver).

    The driver queues requests with :meth:`step`, which adds them to the engine and runs engine
    steps until a request finishes (or :data:`CALL_MAX_SECONDS` pass), then returns the finished
    outputs, the tokens generated meanwhile and the engine's counters.
    """

    def __init__(self, engine: EngineConfig, threads: int | None,
                 factory: Callable[[EngineConfig], Any] | None = None) -> None:
        t0 = time.perf_counter()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        quiet_libraries()  # a replica has no terminal: no progress bars, no info logs
        # deferred: torch (~5 s) only inside a replica; the run layer stays torch-free
        import torch

        if threads:
            torch.set_num_threads(threads)
            if engine.num_threads == "auto":  # the replica's CPUs, not the host's
                engine = replace(engine, num_threads=threads)
        self.engine = (factory or build_engine)(engine)
        self.load_seconds = time.perf_counter() - t0

    def ready(self) -> dict[str, Any]:
        """Where this replica runs and what it holds (called once, after loading)."""
        node, gpus = ray_location()
        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": node, "gpu_ids": gpus,
                **thread_figures(self.engine), "max_model_len": self.engine.max_model_len,
                "load_seconds": self.load_seconds}

    def step(self, requests: list[Any], max_seconds: float = CALL_MAX_SECONDS) -> tuple[list[Any], int, dict]:
        finished = []
        for request in requests:
            rejected = self.engine.add_request(request)
            if rejected is not None:
                finished.append(rejected)
        tokens = 0
        t0 = time.perf_counter()
        while self.engine.has_unfinished_requests():
            done, num_new = self.engine.step()
            tokens += num_new
            finished.extend(done)
            if finished or time.perf_counter() - t0 >= max_seconds:
                break
        return finished, tokens, stats_dict(self.engine.stats())


_SUMMED = ("num_blocks", "kv_cache_bytes", "peak_blocks_used", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "num_cow_copies", "num_prompt_tokens", "num_generated_tokens",
           "num_prefill_tokens", "num_steps", "physical_blocks", "logical_blocks",
           "prefix_cache_hit_blocks", "num_evictions", "num_released_blocks")
# Counters that restart at zero with a new incarnation and add up over its life.
COUNTERS = tuple(k for k in _SUMMED if k not in ("num_blocks", "kv_cache_bytes", "peak_blocks_used"))


def aggregate_stats(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Engine stats over replicas: counters and sizes summed (``peak_blocks_used`` is the sum of
    the replicas' peaks), the ratios recomputed."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    total: dict[str, Any] = {k: sum(int(p.get(k, 0)) for p in parts) for k in _SUMMED}
    total["block_size"] = parts[0].get("block_size")
    logical, queries = total["logical_blocks"], total["prefix_cache_queries"]
    total["saving"] = 1.0 - total["physical_blocks"] / logical if logical else 0.0
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
    return total
