"""Fixtures of the kernel tests: the same tests run on the CPU harness and, if present, a GPU.

``runner`` is parametrised over ``cpu`` (the g++-built kernels under two warp-by-warp schedules,
shared memory poisoned with NaN for the first and a huge finite value for the second) and ``gpu``
(real cupy on a CUDA device; skipped with the reason when there is none).
"""

from __future__ import annotations

import pytest
import torch
from kernel_runners import CPU_SCHEDULES, Runner, gpu_skip_reason, harness_ops


@pytest.fixture(scope="session", params=["cpu", "gpu"])
def runner(request: pytest.FixtureRequest) -> Runner:
    if request.param == "cpu":
        return Runner("cpu", torch.device("cpu"),
                      [(f"{s}/{p}", harness_ops(s, p)) for s, p in CPU_SCHEDULES])
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops

    return Runner("gpu", torch.device("cuda"), [("cupy", get_cuda_ops())])


@pytest.fixture
def kernel_threads():
    """Set the C kernels' thread count for one test (``kernel_threads(n)``), then restore it."""
    from batchgen.kernels.cpu import c_build

    before = c_build.num_threads()
    yield c_build.set_num_threads
    c_build.set_num_threads(before)
