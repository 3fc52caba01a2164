"""The thread policy (``batchgen/threads.py``): CPUs counted from the affinity mask and the
cgroup quota (v2 and v1, the tightest along the path), ``num_threads: auto`` and the split
between batchgen's kernels and torch. The cgroup files are laid out in a temporary folder."""

from __future__ import annotations

import os

import pytest

from batchgen import threads


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """Point the module at a fake /sys/fs/cgroup and /proc/self/cgroup; returns a writer."""
    root = tmp_path / "sys"
    proc = tmp_path / "proc_cgroup"
    monkeypatch.setattr(threads, "_CGROUP_ROOT", root)
    monkeypatch.setattr(threads, "_PROC_CGROUP", proc)

    def write(proc_text: str, files: dict[str, str]) -> None:
        proc.write_text(proc_text)
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return write


def test_cgroup_v2_quota_the_tightest_along_the_path(cgroup) -> None:
    cgroup("0::/jobs/run7\n", {"cpu.max": "max 100000\n", "jobs/cpu.max": "300000 100000\n",
                               "jobs/run7/cpu.max": "150000 100000\n"})
    assert threads.cgroup_cpu_limit() == 1.5
    cgroup("0::/jobs/run7\n", {"jobs/run7/cpu.max": "max 100000\n"})  # the parent's 3 CPUs bind
    assert threads.cgroup_cpu_limit() == 3.0


def test_cgroup_v1_quota_and_none(cgroup) -> None:
    cgroup("5:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
           {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert threads.cgroup_cpu_limit() == 2.0
    cgroup("5:cpu,cpuacct:/other\n", {"cpu,cpuacct/other/cpu.cfs_quota_us": "-1\n",
                                      "cpu,cpuacct/other/cpu.cfs_period_us": "100000\n"})
    assert threads.cgroup_cpu_limit() is None  # -1: no quota
    cgroup("0::/\n", {})
    assert threads.cgroup_cpu_limit() is None


def test_available_cpus_is_the_affinity_capped_by_the_quota(cgroup, monkeypatch) -> None:
    monkeypatch.setattr(threads, "_affinity_cpus", lambda: 8)
    cgroup("0::/\n", {"cpu.max": "250000 100000\n"})
    assert threads.available_cpus() == 3  # 2.5 CPUs: three threads
    cgroup("0::/\n", {"cpu.max": "50000 100000\n"})
    assert threads.available_cpus() == 1
    cgroup("0::/\n", {"cpu.max": "max 100000\n"})
    assert threads.available_cpus() == 8


def test_this_process_counts_its_own_affinity() -> None:
    if hasattr(os, "sched_getaffinity"):
        assert 1 <= threads.available_cpus() <= len(os.sched_getaffinity(0))


def test_resolve_num_threads(monkeypatch) -> None:
    monkeypatch.setattr(threads, "available_cpus", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.resolve_num_threads("auto") == threads.resolve_num_threads(None) == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.resolve_num_threads("auto") == 3  # the user's setting
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert threads.resolve_num_threads("auto") == 6
    assert threads.resolve_num_threads(4) == 4
    for bad in (0, -1, "8", 2.0, True):
        with pytest.raises(ValueError, match="num_threads must be 'auto' or an integer >= 1"):
            threads.resolve_num_threads(bad)


def test_plan_and_apply() -> None:
    import torch

    from batchgen.kernels.cpu import c_build

    assert threads.plan(4, c_kernels=True) == threads.ThreadPlan(kernels=4, torch=1)
    assert threads.plan(4, c_kernels=False) == threads.ThreadPlan(kernels=4, torch=4)
    before = torch.get_num_threads(), c_build.num_threads()
    try:
        threads.apply(threads.ThreadPlan(kernels=3, torch=1))
        assert c_build.num_threads() == 3 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before[0])
        c_build.set_num_threads(before[1])
