"""The CPU kernels' thread pool (``kernels/cpu/pool.h``), through a probe library that records
which chunks ran, on which thread: every item runs exactly once, chunks are contiguous and at
least ``grain`` long, the chunking depends only on (n, grain, threads), nested calls and a
forked child work, and ``c_build.set_num_threads`` reaches libraries loaded before and after.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.kernels.cpu import c_build

PROBE = Path(__file__).resolve().parent / "data" / "pool_probe.c"
POOL_H = Path(c_build.__file__).resolve().parent / "pool.h"
pytestmark = pytest.mark.skipif(c_build.compiler() is None, reason="no C compiler")


def _declare(lib) -> None:
    lib.probe_run.restype = None
    lib.probe_run.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.batchgen_num_threads.restype = ctypes.c_int


@pytest.fixture(scope="module")
def probe_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pool_probe")
    shutil.copy(PROBE, folder / PROBE.name)
    shutil.copy(POOL_H, folder / "pool.h")
    return folder / PROBE.name


@pytest.fixture
def threads(kernel_threads):
    return kernel_threads


def _probe(source: Path, tag: str = "a"):
    return c_build.load_library("the pool probe", source, _declare, (f"-DPROBE_{tag.upper()}",), tag=tag)


def _run(lib, n: int, grain: int, sleep_ns: int = 0, nested: int = 0):
    size = n * max(nested, 1)
    count, extent, thread = (torch.zeros(size, dtype=torch.int64) for _ in range(3))
    lib.probe_run(n, grain, count.data_ptr(), extent.data_ptr(), thread.data_ptr(), sleep_ns, nested)
    return count, extent, thread


def _chunks(extent: torch.Tensor) -> list[tuple[int, int]]:
    starts = extent.nonzero().flatten().tolist()
    return [(s, s + int(extent[s])) for s in starts]


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("n,grain", [(1, 1), (5, 1), (7, 3), (100, 1), (1000, 16), (12345, 7), (3, 8)])
def test_every_item_runs_once_in_contiguous_chunks(probe_source, threads, num_threads, n, grain):
    threads(num_threads)
    lib = _probe(probe_source)
    assert lib.batchgen_num_threads() == num_threads
    count, extent, _ = _run(lib, n, grain)
    assert torch.equal(count, torch.ones(n, dtype=torch.int64))
    chunks = _chunks(extent)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, no overlap
    if n >= grain:
        assert all(end - begin >= grain for begin, end in chunks)
    # at most 4 chunks per thread, one on one thread
    assert len(chunks) <= (1 if num_threads == 1 else 4 * num_threads)
    # the chunking depends only on (n, grain, threads)
    assert _chunks(_run(lib, n, grain)[1]) == chunks


def test_two_threads_share_the_work(probe_source, threads):
    threads(2)
    lib = _probe(probe_source)
    # chunks that sleep 2 ms: a worker gets some unless the machine starves it every time
    seen = set()
    for _ in range(5):
        count, extent, thread = _run(lib, 8, 1, sleep_ns=2_000_000)
        assert torch.equal(count, torch.ones(8, dtype=torch.int64))
        seen = {int(thread[b]) for b, _ in _chunks(extent)}
        if len(seen) == 2:
            break
    assert len(seen) == 2


def test_a_nested_call_runs_on_its_caller(probe_source, threads):
    threads(2)
    lib = _probe(probe_source)
    count, extent, _ = _run(lib, 16, 1, nested=10)
    assert torch.equal(count, torch.ones(160, dtype=torch.int64))
    # each nested call was split as any two-thread call of 10 items: 8 chunks (4 per thread)
    want = [(10 * c // 8, 10 * (c + 1) // 8) for c in range(8)]
    for i in range(16):
        assert _chunks(extent[i * 10:(i + 1) * 10]) == want


def test_the_thread_count_reaches_every_library(probe_source, threads):
    before = _probe(probe_source, "b")
    threads(3)
    after = _probe(probe_source, "c")  # loaded after the call
    assert before.batchgen_num_threads() == after.batchgen_num_threads() == c_build.num_threads() == 3
    threads(1)
    assert before.batchgen_num_threads() == after.batchgen_num_threads() == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="thread count"):
            c_build.set_num_threads(bad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_gets_a_working_pool(probe_source, threads):
    threads(2)
    lib = _probe(probe_source)
    _run(lib, 64, 1)  # the parent's workers are running
    pid = os.fork()
    if pid == 0:  # the child: the workers did not come along; new ones must start
        ok = all(bool((_run(lib, 64, 1)[0] == 1).all()) for _ in range(20))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
