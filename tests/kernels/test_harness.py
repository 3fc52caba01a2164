"""The CPU harness itself: built-ins, schedules, poisoning, divergence reports, sanitizers.

``data/harness_cases.cu`` holds small kernels, each correct or with exactly one planted defect;
every defect must be reported (as an error or a wrong result), never hang.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_harness import CpuModule, HarnessError, parse_kernels
from cuda_harness.backend import HarnessBackend
from kernel_cases import assert_close_to_reference, make_decode_case, reference_decode

from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cuda.cuda_attention import KernelOps

CASES = Path(__file__).parent / "data" / "harness_cases.cu"
FIBER_SCHEDULES = ["warp", "warp_reverse", "round_robin", "random"]
ALL_SCHEDULES = FIBER_SCHEDULES + ["threads"]


def module(schedule: str = "warp", poison: str = "nan", sanitizer: str | None = None) -> CpuModule:
    return CpuModule(CASES, {}, schedule=schedule, poison=poison, sanitizer=sanitizer)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_correct_kernel_runs_on_every_schedule(schedule: str) -> None:
    x = torch.arange(3 * 128, dtype=torch.float32)
    out = torch.empty_like(x)
    module(schedule).get_function("block_reverse")((3,), (128,), (out, x), shared_mem=128 * 4)
    assert torch.equal(out, x.view(3, 128).flip(1).reshape(-1))


def test_missing_barrier_reads_poison_under_warp_by_warp_schedule() -> None:
    x = torch.arange(128, dtype=torch.float32)
    out = torch.empty_like(x)
    module("warp", "nan").get_function("block_reverse_no_sync")((1,), (128,), (out, x),
                                                                 shared_mem=128 * 4)
    # Warp 0 runs to completion first: it reads slots that warps 1..3 have not written yet.
    assert torch.isnan(out[:32]).all()
    out.zero_()
    module("warp", "huge").get_function("block_reverse_no_sync")((1,), (128,), (out, x),
                                                                  shared_mem=128 * 4)
    assert (out[:32] == 1e30).all()


@pytest.mark.parametrize("kernel,message", [
    ("divergent_barrier", "divergent __syncthreads"),
    ("barrier_in_branches", "waits on line"),
    ("extra_barrier", "divergent __syncthreads"),
    ("divergent_shuffle", "divergent warp operation"),
])
@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_divergence_is_an_error_not_a_hang(kernel: str, message: str, schedule: str) -> None:
    out = torch.zeros(64)
    with pytest.raises(HarnessError, match=message):
        module(schedule).get_function(kernel)((1,), (64,), (out,))


def test_shuffle_semantics() -> None:
    out = torch.zeros(4 * 64, dtype=torch.int32)
    module("round_robin").get_function("shuffle_ops")((1,), (64,), (out,))
    tid = np.arange(64)
    lane, base = tid % 32, tid - tid % 32
    v = tid * 10
    up = np.where(lane >= 2, base + lane - 2, tid)
    down = np.where(lane + 4 < 32, base + lane + 4, tid)
    want = np.concatenate([v[base + (lane ^ 5)], v[base + 3], v[up], v[down]])
    assert np.array_equal(out.numpy(), want)


def test_launch_arguments_are_checked_like_a_strict_rawkernel() -> None:
    f = module().get_function("smem_overflow")
    out = torch.zeros(32)
    with pytest.raises(HarnessError, match=r"argument 1 \(int n\) expects numpy.int32, got int"):
        f((1,), (32,), (out, 3))
    with pytest.raises(HarnessError, match="takes 2 arguments, got 1"):
        f((1,), (32,), (out,))
    with pytest.raises(HarnessError, match="expects a CPU tensor"):
        f((1,), (32,), (np.float32(1), np.int32(0)))
    with pytest.raises(HarnessError, match="must be contiguous"):
        f((1,), (32,), (torch.zeros(64)[::2], np.int32(0)))
    with pytest.raises(HarnessError, match="invalid block size"):
        f((1,), (2048,), (out, np.int32(0)))
    with pytest.raises(HarnessError, match="no kernel named"):
        module().get_function("nope")


@pytest.mark.parametrize("schedule", FIBER_SCHEDULES)
def test_illegal_address_is_an_error_not_a_crash(schedule: str) -> None:
    # As a GPU reports an illegal address, the harness turns a fault into an error (a kernel
    # that reads through a poisoned shared-memory index would otherwise kill the process).
    x = torch.arange(32, dtype=torch.float32)
    out = torch.zeros(32)
    f = module(schedule).get_function("wild_read")
    f((1,), (32,), (out, x, np.int64(3)))
    assert out[5] == 3 and out[7] == 7
    with pytest.raises(HarnessError, match=r"illegal memory access \(SIGSEGV\) by thread \(5,0,0\)"):
        f((1,), (32,), (out, x, np.int64(1 << 44)))
    f((1,), (32,), (out, x, np.int64(4)))  # the module still works afterwards
    assert out[5] == 4


def test_parse_kernels_reads_signatures() -> None:
    src = ('extern "C" __global__ void __launch_bounds__(128, 1) k(\n'
           '    float* __restrict__ out,  // [n]\n    const long long* map, int n, float s) {}\n')
    params = parse_kernels(src)["k"]
    assert [(p.ctype, p.name, p.is_pointer) for p in params] == [
        ("float * __restrict__", "out", True), ("const long long *", "map", True),
        ("int", "n", False), ("float", "s", False)]
    assert params[1].base == "long long *"


# ------------------------------------------------------------------------- sanitizers
def test_thread_sanitizer_reports_the_race() -> None:
    x = torch.ones(64)
    out = torch.zeros(1)
    with pytest.raises(HarnessError, match="data race"):
        module("threads", sanitizer="thread").get_function("racy_sum")((1,), (64,), (out, x),
                                                                       shared_mem=64 * 4)


def test_thread_sanitizer_passes_the_correct_kernel() -> None:
    x = torch.arange(128, dtype=torch.float32)
    out = torch.empty_like(x)
    module("threads", sanitizer="thread").get_function("block_reverse")(
        (1,), (128,), (out, x), shared_mem=128 * 4)
    assert torch.equal(out, x.flip(0))


def test_address_sanitizer_reports_shared_memory_overflow() -> None:
    out = torch.zeros(32)
    f = module("threads", sanitizer="address").get_function("smem_overflow")
    f((1,), (32,), (out, np.int32(31)), shared_mem=32 * 4)  # last valid slot: fine
    with pytest.raises(HarnessError, match="heap-buffer-overflow"):
        f((1,), (32,), (out, np.int32(32)), shared_mem=32 * 4)


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_paged_attention_kernels_under_sanitizers(sanitizer: str) -> None:
    ops = KernelOps(HarnessBackend(schedule="threads", poison="nan", sanitizer=sanitizer))
    dtype = torch.float16
    # Decode with one single-pass and one split-K sequence (exercises the reduce kernel).
    case = make_decode_case(dtype=dtype, head_size=64, block_size=8, context_lens=[13, 300],
                            num_kv_heads=1, group=2, seed=11)
    out = ops.paged_decode_attention(*case.args())
    assert_close_to_reference(out, reference_decode(case), dtype, sanitizer)
    # Cache write and copy-on-write copy.
    gen = torch.Generator().manual_seed(12)
    kv = torch.randn(2, 2, 6, 8, 1, 64, generator=gen).to(dtype)
    key = torch.randn(5, 1, 64, generator=gen).to(dtype)
    value = torch.randn(5, 1, 64, generator=gen).to(dtype)
    slots = torch.tensor([0, 9, 17, 30, 47])
    want = kv.clone()
    reference.reshape_and_cache(key, value, want[0, 0], want[0, 1], slots)
    reference.copy_blocks(want, torch.tensor([[1, 4], [2, 5]]))
    ops.reshape_and_cache(key, value, kv[0, 0], kv[0, 1], slots)
    ops.copy_blocks(kv, torch.tensor([[1, 4], [2, 5]]))
    assert torch.equal(kv, want)
