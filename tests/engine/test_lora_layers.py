"""LoRALinear and its C kernel: each row gets ``base(x) + scale·(x·Aᵀ)·Bᵀ`` of its own adapter
(float64 reference), on packed, quantized and merged base layers; a row's result is the same
bits alone, in any batch, and on any thread count; base rows are left untouched."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchgen.engine.fused_layers import merge_linears
from batchgen.kernels.cpu import c_build
from batchgen.kernels.cpu.linear import PackedLinear
from batchgen.kernels.cpu.quant import QuantizedLinear
from batchgen.lora.adapter import ModuleDelta
from batchgen.lora.layers import LoRAContext, LoRALinear, Part



def quantized(qtype: Q, rows: int, seed: int):
    """GGUF bytes of a random ``[rows, IN]`` weight, quantized by ``gguf``."""
    import gguf
    import numpy as np

    w = np.random.default_rng(seed).normal(0, 0.5, size=(rows, IN)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)

IN, WIDTHS = 64, (48, 16, 16)  # a merged q/k/v: q 48 columns, k and v 16 each


def _delta(gen: torch.Generator, rank: int, out: int, scale: float) -> ModuleDelta:
    return ModuleDelta(torch.randn(rank, IN, generator=gen), torch.randn(out, rank, generator=gen), scale)


def _layer(base: torch.nn.Module, widths: tuple[int, ...], slots: int = 3) -> tuple[LoRALinear, list[dict]]:
    """A LoRALinear over ``base`` with parts of ``widths``; slot s gets a random adapter on some
    of the parts (slot 0: all, rank 8; slot 1: the first and last, rank 16; slot 2: none)."""
    names = [f"p{i}" for i in range(len(widths))]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    parts = [Part(n, s, s + w, IN) for n, s, w in zip(names, starts, widths)]
    layer = LoRALinear(base, parts, LoRAContext(), slots)
    gen = torch.Generator().manual_seed(0)
    chosen = [dict(zip(names, (8,) * len(names))), {names[0]: 16, names[-1]: 16}, {}]
    adapters = []
    for slot, ranks in enumerate(chosen[:slots]):
        deltas = {n: _delta(gen, r, widths[names.index(n)], 0.5 + slot) for n, r in ranks.items()}
        layer.set_slot(slot, deltas or None)
        adapters.append(deltas)
    return layer, adapters


def _reference(layer: LoRALinear, adapters: list[dict], x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    base = layer.base(x).double()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        for part in layer.parts:
            d = adapters[slot].get(part.module)
            if d is not None:
                base[row, part.start:part.stop] += d.scale * (x[row].double() @ d.a.double().t()) @ d.b.double().t()
    return base


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` of the reference's largest magnitude (float32 sums of 64 products)."""
    return bool((got.double() - want).abs().max() <= tol * want.abs().max())


def _run(layer: LoRALinear, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    layer.context.set(torch.tensor(slots, dtype=torch.int32), frozenset(s for s in slots if s >= 0))
    with torch.no_grad():
        return layer(x)


def _bases() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    linears = [torch.nn.Linear(IN, w, bias=False) for w in WIDTHS]
    kinds = (Q.Q4_0, Q.Q4_0, Q.Q8_0)  # a Q4_K_M-like mix: one merged layer of two block types
    quant = [QuantizedLinear(quantized(t, w, seed=w + i), t, w, IN) for i, (t, w) in enumerate(zip(kinds, WIDTHS))]
    return {"linear": linears[0], "packed": PackedLinear(linears[0]), "merged": merge_linears(linears),
            "quantized": quant}


@pytest.mark.parametrize("kind", ["linear", "packed", "merged"])
def test_each_row_gets_its_own_adapter(kind: str) -> None:
    base = _bases()[kind]
    widths = WIDTHS if kind == "merged" else (WIDTHS[0],)
    layer, adapters = _layer(base, widths)
    slots = [0, -1, 1, 2, 0, 1, -1, 0]
    x = torch.randn(len(slots), IN)
    got = _run(layer, x, slots)
    want = _reference(layer, adapters, x, slots)
    assert _close(got, want, 1e-5)
    plain = layer.base(x)
    for row, slot in enumerate(slots):
        if slot in (-1, 2):  # the base, or an adapter without this layer: untouched bits
            assert torch.equal(got[row], plain[row])


def test_a_quantized_base_gets_the_float_delta() -> None:
    base = merge_linears(_bases()["quantized"])
    layer, adapters = _layer(base, WIDTHS)
    slots = [1, 0, -1, 0]
    x = torch.randn(len(slots), IN)
    got = _run(layer, x, slots)
    assert _close(got, _reference(layer, adapters, x, slots), 1e-5)


def test_a_row_is_the_same_bits_alone_in_any_batch_and_on_any_thread_count() -> None:
    layer, _ = _layer(_bases()["merged"], WIDTHS)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(-1, 3, (37,), generator=gen).tolist()
    x = torch.randn(len(slots), IN, generator=gen)
    before = c_build.num_threads()
    try:
        c_build.set_num_threads(2)
        batched = _run(layer, x, slots)
        c_build.set_num_threads(1)
        single_thread = _run(layer, x, slots)
    finally:
        c_build.set_num_threads(before)
    assert torch.equal(batched, single_thread)
    for row in (0, 5, 36):
        alone = _run(layer, x[row:row + 1], slots[row:row + 1])
        assert torch.equal(alone[0], batched[row])
    order = torch.randperm(len(slots), generator=gen)
    shuffled = _run(layer, x[order], [slots[i] for i in order.tolist()])
    assert torch.equal(shuffled, batched[order])


def test_the_avx512_and_the_plain_c_builds_agree_bit_for_bit() -> None:
    from batchgen.kernels.cpu import lora as cpu_lora

    widths = (80, 16, 144)  # whole 64-column chunks (the AVX-512 loop) and tails (the C loop)
    torch.manual_seed(1)
    layer, _ = _layer(merge_linears([torch.nn.Linear(IN, w, bias=False) for w in widths]), widths)
    gen = torch.Generator().manual_seed(2)
    slots = torch.randint(-1, 3, (21,), generator=gen).tolist()
    x = torch.randn(len(slots), 40 + IN, generator=gen)[:, :IN]  # rows with a stride, not contiguous
    native = _run(layer, x, slots)
    layer._kernel = cpu_lora.load_lora("plain").batchgen_lora_f32
    assert torch.equal(_run(layer, x, slots), native)


def test_16_bit_outputs_get_the_float32_delta_and_keep_rows_invariant() -> None:
    torch.manual_seed(0)
    base = torch.nn.Linear(IN, 32, bias=False).to(torch.bfloat16)
    layer, adapters = _layer(base, (32,))
    slots = [0, -1, 1]
    x = torch.randn(len(slots), IN).to(torch.bfloat16)
    got = _run(layer, x, slots)
    want = _reference(layer, adapters, x, slots)
    assert got.dtype is torch.bfloat16
    assert _close(got, want, 2e-2)
    for row in range(len(slots)):
        alone = _run(layer, x[row:row + 1], slots[row:row + 1])
        assert torch.equal(alone[0], got[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_path_keeps_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """The torch path (the one CUDA takes) in fixed chunks: a row's delta does not depend on the
    number, the order or the adapters of the rows beside it (checked on the CPU's torch)."""
    torch.manual_seed(0)
    layer, adapters = _layer(torch.nn.Linear(IN, sum(WIDTHS), bias=False).to(dtype), WIDTHS)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randint(-1, 3, (41,), generator=gen).tolist()  # more than 2 chunks of slot 0
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)

    def torch_path(xs: torch.Tensor, ss: list[int]) -> torch.Tensor:
        """The delta alone (torch's own base matmul is not row-invariant)."""
        layer.context.set(torch.tensor(ss, dtype=torch.int32), frozenset(s for s in ss if s >= 0))
        y = torch.zeros(len(ss), sum(WIDTHS), dtype=dtype)
        with torch.no_grad():
            layer._add_torch(xs, y)
        return y

    batched = torch_path(x, slots)
    with torch.no_grad():
        want = _reference(layer, adapters, x, slots) - layer.base(x).double()
    assert _close(batched, want, 1e-5 if dtype is torch.float32 else 2e-2)
    for row in (0, 7, 40):
        assert torch.equal(torch_path(x[row:row + 1], slots[row:row + 1])[0], batched[row])
    order = torch.randperm(len(slots), generator=gen)
    assert torch.equal(torch_path(x[order], [slots[i] for i in order.tolist()]), batched[order])
