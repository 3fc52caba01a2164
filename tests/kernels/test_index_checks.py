"""Value checks of the CUDA ops' indices (context lengths, block ids, slots), run on the CPU.

The checks are torch ops on the tensors' own device, so CPU tensors exercise the same code a
GPU runs. ``KernelOps`` drives a recording backend here: a bad value must raise before any
launch, a valid one must launch, and a step's tables are checked once across its layers.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cuda import checks
from batchgen.kernels.cuda.cuda_attention import KernelInputError, KernelOps


class _Launches:
    """A Backend whose kernels only record their launches."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.launched: list[str] = []

    def module(self, dtype: torch.dtype, head_size: int, block_size: int) -> Any:
        backend = self

        class Module:
            def get_function(self, name: str):
                return lambda *args, **kwargs: backend.launched.append(name)

        return Module()

    def arg(self, tensor: torch.Tensor) -> Any:
        return tensor

    def launch_context(self, device: torch.device):
        return nullcontext()


def _pool(num_blocks: int = 6, block_size: int = 16, kv_heads: int = 2, head: int = 64):
    k = torch.zeros(num_blocks, block_size, kv_heads, head)
    return k, k.clone()


def _decode(ops: KernelOps, tables: list[list[int]], lens: list[int], num_blocks: int = 6):
    k, v = _pool(num_blocks)
    q = torch.zeros(len(lens), 4, 64)
    return ops.paged_decode_attention(q, k, v, torch.tensor(tables, dtype=torch.int32).reshape(len(lens), -1),
                                      torch.tensor(lens, dtype=torch.int32), 0.125)


@pytest.mark.parametrize("tables,lens,message", [
    ([[0, 1, 2]], [0], r"context_lens must be in \[1, 48\] .*context_lens\[0\] = 0"),
    ([[0, 1, 2], [3, 4, 5]], [5, 49], r"context_lens\[1\] = 49"),
    ([[0, 1, 2]], [-3], r"context_lens\[0\] = -3"),
    ([[0, 6, 2]], [17], r"entries a sequence reads must be in \[0, 6\) .*block_tables\[0, 1\] = 6"),
    ([[0, 1, 2], [1, 2, -1]], [48, 33], r"block_tables\[1, 2\] = -1 \(context_lens\[1\] = 33\)"),
])
def test_decode_rejects_out_of_range_indices_before_launching(tables, lens, message) -> None:
    backend = _Launches()
    ops = KernelOps(backend)
    with pytest.raises(KernelInputError, match="paged_decode_attention: .*" + message):
        _decode(ops, tables, lens)
    assert backend.launched == []


def test_padding_past_a_sequences_blocks_is_not_checked() -> None:
    backend = _Launches()
    # sequence 0 reads blocks 0..1 (17 tokens); its third entry is garbage and never read
    _decode(KernelOps(backend), [[0, 1, 99999], [2, 3, 4]], [17, 48])
    assert backend.launched[0] == "paged_decode"


def test_checks_off_launches_whatever_it_is_given() -> None:
    backend = _Launches()
    _decode(KernelOps(backend, check_indices=False), [[0, 99, 2]], [400])
    assert backend.launched[0] == "paged_decode"


def test_cache_ops_reject_slots_and_block_ids_outside_the_pool() -> None:
    backend = _Launches()
    ops = KernelOps(backend)
    k, v = _pool(num_blocks=4)  # 64 slots
    key = torch.zeros(3, 2, 64)
    ops.reshape_and_cache(key, key, k, v, torch.tensor([-1, 0, 63]))  # padding and the last slot
    with pytest.raises(KernelInputError, match=r"reshape_and_cache: slot_mapping entries must be "
                                               r"below 64 .*slot_mapping\[1\] = 64"):
        ops.reshape_and_cache(key, key, k, v, torch.tensor([5, 64, 0]))
    kv = torch.zeros(2, 2, 4, 16, 2, 64)
    ops.copy_blocks(kv, torch.tensor([[0, 3], [1, 2]]))
    for bad, where in (([[0, 4]], "[0, 1] = 4"), ([[-1, 2]], "[0, 0] = -1")):
        with pytest.raises(KernelInputError, match=r"copy_blocks: block_mapping entries must be in "
                                                   r"\[0, 4\) .*block_mapping" + re_escape(where)):
            ops.copy_blocks(kv, torch.tensor(bad))
    assert backend.launched == ["reshape_and_cache", "copy_blocks"]


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_prefill_checks_then_matches_the_reference() -> None:
    ops = KernelOps(_Launches())
    torch.manual_seed(0)
    k, v = torch.randn(6, 16, 2, 64), torch.randn(6, 16, 2, 64)
    q = torch.randn(5, 4, 64)
    tables = torch.tensor([[4, 2, 0], [1, 3, 5]], dtype=torch.int32)
    starts = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([20, 2], dtype=torch.int32)
    got = ops.paged_prefill_attention(q, k, v, tables, starts, lens, 0.125)
    torch.testing.assert_close(got, reference.paged_prefill_attention(q, k, v, tables, starts, lens, 0.125),
                               rtol=0, atol=0)
    for over, message in [
        (dict(starts=torch.tensor([0, 3, 4], dtype=torch.int32)), "end at the 5 query tokens"),
        (dict(starts=torch.tensor([0, 4, 5], dtype=torch.int32), lens=torch.tensor([3, 2], dtype=torch.int32)),
         "sequence 0 has 4 query tokens and context_lens"),
        (dict(tables=torch.tensor([[4, 2, 0], [6, 3, 5]], dtype=torch.int32)), r"block_tables\[1, 0\] = 6"),
        (dict(lens=torch.tensor([20, 49], dtype=torch.int32)), r"context_lens\[1\] = 49"),
    ]:
        args = dict(tables=tables, starts=starts, lens=lens) | over
        with pytest.raises(KernelInputError, match="paged_prefill_attention: .*" + message):
            ops.paged_prefill_attention(q, k, v, args["tables"], args["starts"], args["lens"], 0.125)


def test_a_steps_tables_are_checked_once_across_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = checks.context_violation
    monkeypatch.setattr(checks, "context_violation", lambda *a: calls.append("ctx") or real(*a))
    ops = KernelOps(_Launches())
    k, v = _pool()
    q = torch.zeros(2, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    for _layer in range(4):  # the engine hands the same tensors to every layer
        ops.paged_decode_attention(q, k, v, tables, lens, 0.125)
    assert calls == ["ctx"]
    # A new step's tensors, and an in-place change of a checked one, are checked again.
    lens2 = lens.clone()
    ops.paged_decode_attention(q, k, v, tables, lens2, 0.125)
    assert calls == ["ctx"] * 2
    lens2[1] = 33
    with pytest.raises(KernelInputError, match=r"context_lens\[1\] = 33"):
        ops.paged_decode_attention(q, k, v, tables, lens2, 0.125)
    # Another pool (fewer blocks) is another check for the same tables.
    with pytest.raises(KernelInputError, match=r"block_tables\[1, 0\] = 2"):
        ops.paged_decode_attention(q, k[:2].contiguous(), v[:2].contiguous(), tables, lens, 0.125)


def test_inference_tensors_are_checked_and_remembered() -> None:
    # The engine builds its step tensors under inference_mode (no version counter).
    ops = KernelOps(_Launches())
    k, v = _pool()
    with torch.inference_mode():
        tables = torch.tensor([[0, 7]], dtype=torch.int32)
        lens = torch.tensor([20], dtype=torch.int32)
        with pytest.raises(KernelInputError, match=r"block_tables\[0, 1\] = 7"):
            ops.paged_decode_attention(torch.zeros(1, 4, 64), k, v, tables, lens, 0.125)
        ok = torch.tensor([[0, 5]], dtype=torch.int32)
        ops.paged_decode_attention(torch.zeros(1, 4, 64), k, v, ok, lens, 0.125)
        assert ops._checked.seen("decode", (ok, lens), (6, 16))


def test_check_functions_agree_with_the_cpu_kernel_on_random_tables() -> None:
    # The CPU kernel's own first pass is the oracle: both accept or both reject.
    from batchgen.kernels.cpu.cpu_attention import paged_attention

    gen = torch.Generator().manual_seed(7)
    k, v = torch.zeros(5, 8, 1, 64), torch.zeros(5, 8, 1, 64)
    verdicts = set()
    for _ in range(60):
        tables = torch.randint(-1, 6, (3, 4), generator=gen, dtype=torch.int32)
        lens = torch.randint(0, 34, (3,), generator=gen, dtype=torch.int32)
        ours = checks.context_violation(tables, lens, 5, 8)
        try:
            paged_attention("decode", torch.zeros(3, 2, 64), k, v, tables, None, lens, 0.125)
            theirs = None
        except ValueError as exc:
            theirs = str(exc)
        assert (ours is None) == (theirs is None), (tables, lens, ours, theirs)
        verdicts.add(ours is None)
    assert verdicts == {True, False}  # both outcomes were exercised


def test_engine_option_reaches_the_cuda_ops() -> None:
    from batchgen.config import RunConfig
    from batchgen.run.executors import engine_config
    from batchgen.kernels import get_ops

    base = {"data": {"source": "rows.jsonl"}, "output": {"path": "out.jsonl"}}
    assert engine_config(RunConfig.model_validate(base)).index_checks is True
    off = RunConfig.model_validate(base | {"engine": {"index_checks": False}})
    assert engine_config(off).index_checks is False
    with pytest.raises(ValueError, match="index_checks"):
        RunConfig.model_validate(base | {"engine": {"index_checks": "sometimes"}})
    from batchgen.kernels.cuda import cuda_attention as kcuda

    saved = dict(kcuda._ops)
    try:
        kcuda._ops.clear()
        kcuda._ops[True] = KernelOps(_Launches())  # stands in for the cupy-backed ops
        off = get_ops("cuda", check_indices=False)
        assert off.check_indices is False and get_ops("cuda").check_indices is True
        assert off.backend is get_ops("cuda").backend  # one compile cache for both
    finally:
        kcuda._ops.clear()
        kcuda._ops.update(saved)
