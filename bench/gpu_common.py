"""What the GPU check's orchestrator (``bench/gpu_check.py``) and its stages
(``bench/gpu_kernel_stages.py``, ``bench/gpu_end_to_end.py``) share: the repo root, the
bandwidth sweep's points and targets, the bytes a decode call moves, the stage result on disk,
and :func:`gpu_point`, where a stage stops in a dry run before its first CUDA call."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parent.parent


# Default budgets in seconds; scaled down together when the deadline is shorter.
# Time a stage leaves unused goes to the next ones.
STAGE_BUDGETS: dict[str, float] = {
    "environment": 30.0,
    "correctness": 45.0,
    "kernel_tests": 30.0,
    "bandwidth": 60.0,
    "flashinfer": 20.0,
    "end_to_end": 70.0,
    "throughput": 90.0,
}
STAGES = tuple(STAGE_BUDGETS)


BENCH_BATCHES = (1, 16, 64, 256)


BENCH_CONTEXTS = (512, 1024, 4096, 16384)


BENCH_HEAD_SIZES = (64, 128)


BENCH_DTYPES = ("float16", "bfloat16")


# A Llama-3-8B-like layer (32 query heads over 8 KV heads), 16-token blocks.
BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, BENCH_BLOCK_SIZE = 32, 8, 16


# The targets: at batch >= 64 and context >= 1K, >= 70 % of peak HBM bandwidth and within
# 1.2x of FlashInfer's time.
TARGET_MIN_BATCH, TARGET_MIN_CONTEXT = 64, 1024


TARGET_FRACTION, TARGET_VS_FLASHINFER = 0.70, 1.2


def decode_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, dtype_bytes: int) -> int:
    """Bytes one decode call must move at the least: what the bandwidth figures divide.

    Every K and V row of every sequence's context, once (``2 · batch · context · kv_heads ·
    head_size`` elements), the query read and the output written (``batch · heads ·
    head_size`` each), the block-table entries read (``ceil(context / block_size)`` int32 per
    sequence) and the context lengths (one int32 each). Split-K scratch and re-reads by a kernel
    are not counted: they are its own cost, not the problem's.
    """
    kv = 2 * batch * context * num_kv_heads * head_size * dtype_bytes
    q_and_out = 2 * batch * num_heads * head_size * dtype_bytes
    tables = batch * math.ceil(context / block_size) * 4 + batch * 4
    return kv + q_and_out + tables


def bench_points(batches=BENCH_BATCHES, contexts=BENCH_CONTEXTS, heads=BENCH_HEAD_SIZES,
                 dtypes=BENCH_DTYPES) -> list[dict[str, Any]]:
    """The bandwidth sweep, target points (batch >= 64, context >= 1K) first."""
    points = [{"dtype": d, "head_size": h, "batch": b, "context": c}
              for d in dtypes for h in heads for b in batches for c in contexts]
    return sorted(points, key=lambda p: not is_target(p))  # stable


def is_target(point: dict[str, Any]) -> bool:
    return point["batch"] >= TARGET_MIN_BATCH and point["context"] >= TARGET_MIN_CONTEXT


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader or a kill never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


class NoGpu(Exception):
    """Raised by :func:`gpu_point` where a stage would make its first CUDA call without a GPU."""


def gpu_point(what: str, device: str = "cuda") -> None:
    """Mark a stage's first CUDA call: without a CUDA device, stop the stage here (the dry run
    records that it got this far). Does nothing on a GPU, or when ``device`` is the CPU (the
    tests run stages there)."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise NoGpu(f"no GPU: stopped before {what}")


class Stage:
    """A stage's result dict, written to disk after every update, and its time budget."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path, self.budget_s = path, budget_s
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"passed": False}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        write_json(self.path, self.data)
