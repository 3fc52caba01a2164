"""Backend selection, the ops' input checks, and the Python mirrors of the kernel constants."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from kernel_runners import harness_ops

from batchgen.kernels import get_ops, resolve_backend
from batchgen.kernels.ops import AttentionOps
from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cuda import cuda_attention as kcuda
from batchgen.kernels.cuda.cuda_attention import KernelInputError, num_partitions


def test_importing_the_package_does_not_import_cupy() -> None:
    code = ("import sys, batchgen.kernels, batchgen.kernels.cuda; "
            "from batchgen.kernels import get_ops; get_ops('torch'); "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_resolve_backend_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("torch", cpu) == "torch"
    assert resolve_backend("auto", cpu) == "cpu"
    assert resolve_backend("cpu", cpu) == "cpu"
    with pytest.raises(RuntimeError, match="needs a CUDA device; the model runs on cpu"):
        resolve_backend("cuda", cpu)
    with pytest.raises(RuntimeError, match="needs the model on the CPU; it runs on cuda:0"):
        resolve_backend("cpu", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, cuda, torch; got 'tpu'"):
        resolve_backend("tpu", cpu)


def test_resolve_backend_rules_for_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import batchgen.kernels as kernels

    gpu = torch.device("cuda", 0)
    for has_gpu, has_cupy, auto in [(True, True, "cuda"), (True, False, "torch"),
                                    (False, True, "torch"), (False, False, "torch")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=has_gpu: v)
        monkeypatch.setattr(kernels, "cupy_available", lambda v=has_cupy: v)
        assert resolve_backend("auto", gpu) == auto
        if auto == "cuda":
            assert resolve_backend("cuda", gpu) == "cuda"
        elif not has_gpu:
            with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
                resolve_backend("cuda", gpu)
        else:
            with pytest.raises(RuntimeError, match=r"needs cupy: pip install 'batchgen\[cuda\]'"):
                resolve_backend("cuda", gpu)


def test_cuda_unsupported_reason_names_the_offending_parameter() -> None:
    from batchgen.kernels import cuda_unsupported_reason

    assert cuda_unsupported_reason(torch.bfloat16, 64, 16) is None
    assert "block_size 64 unsupported" in cuda_unsupported_reason(torch.float16, 128, 64)
    assert "head_size 72 unsupported" in cuda_unsupported_reason(torch.float16, 72, 16)
    assert "dtype torch.float64 unsupported" in cuda_unsupported_reason(torch.float64, 64, 16)


def test_get_ops_exposes_the_reference_signatures() -> None:
    torch_ops = get_ops("torch")
    assert torch_ops is get_ops("torch") and torch_ops.paged_decode_attention is reference.paged_decode_attention
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        get_ops("auto")
    import inspect

    for ops in (torch_ops, harness_ops("warp", "nan"), get_ops("cpu")):
        assert isinstance(ops, AttentionOps), ops  # the protocol every backend implements
        for name in ("reshape_and_cache", "paged_decode_attention", "paged_prefill_attention",
                     "copy_blocks"):
            want = list(inspect.signature(getattr(reference, name)).parameters)
            assert list(inspect.signature(getattr(ops, name)).parameters) == want, (ops, name)
            proto = [p for p in inspect.signature(getattr(AttentionOps, name)).parameters if p != "self"]
            assert proto == want, name


def test_python_constants_mirror_the_kernel_header() -> None:
    header = kcuda.KERNEL_HEADER.read_text()
    values = dict(re.findall(r"#define (BG_\w+) (\d+)\b", header))
    assert int(values["BG_NUM_THREADS"]) == kcuda.NUM_THREADS
    assert int(values["BG_MAX_GROUP"]) == kcuda.MAX_GROUP
    assert int(values["BG_TILE"]) == kcuda.TILE
    assert kcuda.PARTITION_SIZE % kcuda.TILE == 0
    # The decode shared-memory layout: m, l, alpha, row, then q and p, which the epilogue's
    # per-slot partial sums reuse ([BG_NUM_THREADS / vectors per row][8][head_size] floats).
    src = kcuda.KERNEL_SOURCE.read_text()
    assert "#define BG_SMEM_WORDS (BG_SMEM_LOOP_END > BG_SMEM_RED_END ? BG_SMEM_LOOP_END : BG_SMEM_RED_END)" in src
    assert "#define BG_SMEM_RED_END (BG_SMEM_RED + BG_V_SLOTS * BG_MAX_GROUP * BG_HEAD_SIZE)" in src
    assert kcuda.decode_smem_bytes(128, 2) == 4 * (3 * 8 + 64 + max(8 * 128 + 8 * 64, 8 * 8 * 128))
    assert kcuda.decode_smem_bytes(80, 4) == 4 * (3 * 8 + 64 + max(8 * 80 + 8 * 64, 6 * 8 * 80))


def test_split_rule_depends_only_on_the_context_length() -> None:
    p = kcuda.PARTITION_SIZE
    assert [num_partitions(n) for n in (1, p, p + 1, 2 * p, 2 * p + 1)] == [1, 1, 2, 2, 3]


def _decode_inputs(**over):
    base = dict(query=torch.zeros(2, 4, 64, dtype=torch.float16),
                k_cache=torch.zeros(5, 16, 2, 64, dtype=torch.float16),
                v_cache=torch.zeros(5, 16, 2, 64, dtype=torch.float16),
                block_tables=torch.zeros(2, 3, dtype=torch.int32),
                context_lens=torch.ones(2, dtype=torch.int32), scale=0.125)
    base.update(over)
    return base


@pytest.mark.parametrize("over,message", [
    (dict(query=torch.zeros(2, 4, 64)), "query dtype torch.float32 differs from the cache dtype"),
    (dict(query=torch.zeros(2, 4, 64, dtype=torch.float64)), "query must have dtype"),
    (dict(query=torch.zeros(2, 4, 64, 1, dtype=torch.float16)), "query must have 3 dimensions"),
    (dict(k_cache=torch.zeros(5, 2, 16, 64, dtype=torch.float16).transpose(1, 2),
          v_cache=torch.zeros(5, 2, 16, 64, dtype=torch.float16).transpose(1, 2)), "k_cache must be contiguous"),
    (dict(query=torch.zeros(2, 3, 64, dtype=torch.float16)), "num_heads 3 is not a multiple of num_kv_heads 2"),
    (dict(query=torch.zeros(2, 4, 128, dtype=torch.float16)), "query head_size 128 differs from the cache's 64"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables must have dtype torch.int32"),
    (dict(context_lens=torch.ones(3, dtype=torch.int32)), "query has 2 sequences but"),
    (dict(k_cache=torch.zeros(5, 12, 2, 64, dtype=torch.float16),
          v_cache=torch.zeros(5, 12, 2, 64, dtype=torch.float16)), r"block_size 12 unsupported"),
    (dict(v_cache=torch.zeros(6, 16, 2, 64, dtype=torch.float16)), "k_cache .* and v_cache .* must match"),
    (dict(scale=float("nan")), "scale must be a finite float"),
    (dict(k_cache=[1, 2]), "k_cache must be a torch.Tensor, got list"),
])
def test_decode_rejects_bad_inputs_with_a_clear_message(over, message: str) -> None:
    ops = harness_ops("warp", "nan")
    with pytest.raises(KernelInputError, match=f"paged_decode_attention: {message}"):
        ops.paged_decode_attention(**_decode_inputs(**over))


def test_cache_ops_reject_bad_inputs() -> None:
    ops = harness_ops("warp", "nan")
    k = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    with pytest.raises(KernelInputError, match="slot_mapping must have dtype torch.int64"):
        ops.reshape_and_cache(key, key, k, k.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"key must be \[num_tokens, 2, 64\], got \(3, 2, 32\)"):
        ops.reshape_and_cache(key[..., :32], key, k, k.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="disagree on num_tokens: 3, 3, 2"):
        ops.reshape_and_cache(key, key, k, k.clone(), torch.zeros(2, dtype=torch.int64))
    kv = torch.zeros(2, 2, 4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(KernelInputError, match=r"block_mapping must be \[num_pairs, 2\]"):
        ops.copy_blocks(kv, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="kv_cache dimension 1 must be 2"):
        ops.copy_blocks(torch.zeros(2, 3, 4, 16, 2, 64), torch.zeros(1, 2, dtype=torch.int64))


def test_nvrtc_include_dirs_hold_the_fp16_headers(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "include").mkdir()
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    assert str(tmp_path / "include") not in kcuda.nvrtc_include_dirs()  # no headers there
    for name in ("cuda_fp16.h", "cuda_bf16.h"):
        (tmp_path / "include" / name).write_text("")
    assert kcuda.nvrtc_include_dirs()[0] == str(tmp_path / "include")


def test_cupy_source_inlines_the_header() -> None:
    text = kcuda.full_source()
    assert '#include "paged_attention.cuh"' not in text
    assert "#define BG_NUM_THREADS 128" in text and "paged_decode_reduce" in text


def test_cupy_backend_plumbing_with_a_stand_in_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without a GPU, check what CupyBackend hands to cupy: the compile options, the inlined
    # source, bfloat16 passed as int16 through DLPack, and launches scoped to torch's stream.
    import types

    calls: list[tuple] = []

    class Ctx:
        def __init__(self, kind: str, value: object) -> None:
            self.kind, self.value = kind, value

        def __enter__(self):
            calls.append(("enter", self.kind, self.value))
            return self

        def __exit__(self, *exc):
            calls.append(("exit", self.kind, self.value))

    class RawModule:
        def __init__(self, code: str, options: tuple) -> None:
            self.code, self.options = code, options

    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    fake.from_dlpack = lambda t: ("dlpack", t.dtype, t.data_ptr())
    fake.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=lambda i: Ctx("device", i),
        ExternalStream=lambda ptr: Ctx("stream", ptr))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=4242))
    monkeypatch.setenv("CUDA_PATH", "/nonexistent")
    if not kcuda.nvrtc_include_dirs():
        pytest.skip("no cuda_fp16.h on this machine to point NVRTC at")

    backend = kcuda.CupyBackend()
    mod = backend.module(torch.bfloat16, 128, 16)
    assert backend.module(torch.bfloat16, 128, 16) is mod  # compiled once per variant
    assert {"-DBG_DTYPE=2", "-DBG_HEAD_SIZE=128", "-DBG_BLOCK_SIZE=16", "-std=c++17"} <= set(mod.options)
    assert any(o.startswith("-I") for o in mod.options)
    assert mod.code == kcuda.full_source()
    t = torch.zeros(4, dtype=torch.bfloat16)
    assert backend.arg(t) == ("dlpack", torch.int16, t.data_ptr())
    with backend.launch_context(torch.device("cuda", 0)):
        pass
    assert calls == [("enter", "device", 0), ("enter", "stream", 4242),
                     ("exit", "stream", 4242), ("exit", "device", 0)]
