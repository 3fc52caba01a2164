"""LoRALinear: a projection of the base model plus each row's adapter delta, batched.

The model runner wraps every projection LoRA can target (:func:`wrap_model`): q, k, v, o,
gate, up and down, whether plain (``nn.Linear``, the C GEMM's ``PackedLinear``, GGUF's
``QuantizedLinear``) or merged by the CPU path's fusion (a fused attention's ``qkv_proj``, a
fused MLP's ``gate_up_proj``). A merged layer takes a matching merged adapter: the parts'
``lora_A`` stacked into one ``A`` (one shrink over the input), and per part its ``lora_B``
and column range (one expand into each part's columns).

Each forward runs the base layer, then adds ``scale * (x·Aᵀ)·Bᵀ`` of each row's adapter (its
slot in the step's :class:`LoRAContext`; -1: the base model, nothing added): in float32, also
on a quantized base, then added to the output in its dtype. Either way a row's result does
not depend on the adapters or the number of the other rows (the needle rule):

* on the CPU the delta is the C kernel's (:mod:`batchgen.kernels.cpu.lora`: each output sums
  its own row's products in a fixed order), in place on a float32 output, else into a float32
  buffer then added to the 16-bit output;
* elsewhere (CUDA) torch's matmuls per adapter, over chunks of exactly :data:`CHUNK` rows
  (the last one padded with zeros): every matmul has the same shape whatever the batch, so
  the library picks the same algorithm and each row's sums run in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu import lora as cpu_lora
from batchgen.lora.adapter import ModuleDelta

#: Rows per matmul of the torch (CUDA) path: a fixed shape, for row invariance.
CHUNK = 16

#: The projections LoRA applies to (the last part of their module names).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Part:
    """One original projection inside a (possibly merged) layer: its module name (as PEFT's
    keys name it) and its column range in the layer's output."""

    module: str
    start: int
    stop: int
    in_features: int


@dataclass
class LoRAContext:
    """The step's rows: each token's adapter slot (-1: base), or None for an all-base step;
    ``active`` the slots used. Set by :class:`~batchgen.lora.manager.LoRAManager` per step."""

    row_slot: torch.Tensor | None = None
    active: frozenset[int] = field(default_factory=frozenset)
    _on: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def set(self, row_slot: torch.Tensor | None, active: frozenset[int]) -> None:
        self.row_slot, self.active, self._on = row_slot, active, {}

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """``row_slot`` on ``device`` (copied once per step and device)."""
        if device not in self._on:
            self._on[device] = self.row_slot.to(device)
        return self._on[device]


def _targets(model: torch.nn.Module) -> dict[str, list[Part]]:
    """Every layer LoRA can target, by its module name, with its parts."""
    hosts: dict[str, list[Part]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        merged = getattr(module, "merged_projections", None)  # the engine's fused q/k/v and gate/up
        if callable(merged):
            linear, widths = merged()
            hosts[prefix + linear] = _parts(prefix, widths, module.get_submodule(linear).in_features)
        elif name.rsplit(".", 1)[-1] in PROJECTIONS and hasattr(module, "in_features"):
            hosts[name] = [Part(name, 0, int(module.out_features), int(module.in_features))]
    return hosts


def _parts(prefix: str, widths: tuple[tuple[str, int], ...], in_features: int) -> list[Part]:
    parts, start = [], 0
    for leaf, width in widths:
        parts.append(Part(prefix + leaf, start, start + width, int(in_features)))
        start += width
    return parts


def wrap_model(model: torch.nn.Module, context: LoRAContext, max_loras: int) -> dict[str, "LoRALinear"]:
    """Replace each targetable layer of ``model`` by a :class:`LoRALinear` reading
    ``context``; returns them by module name."""
    wrapped = {}
    for name, parts in _targets(model).items():
        layer = LoRALinear(model.get_submodule(name), parts, context, max_loras)
        model.set_submodule(name, layer)
        wrapped[name] = layer
    return wrapped


class LoRALinear(torch.nn.Module):
    """``base(x)`` plus each row's adapter delta over ``parts`` (see the module docstring).

    Slot ``s`` holds ``A`` (the parts' ``lora_A`` stacked, ``[sum of ranks, in]``) and the
    parts' ``lora_B`` transposed, one after the other, with a ``(r0, r1, c0, c1)`` row per part
    and its scale: the tables the C kernel reads.
    """

    #: Its rows' adapter slots are the step's rows by position (``context.row_slot``): a caller
    #: must not pass it a slice of them (:class:`~batchgen.engine.fused_layers.FusedGatedMLP`
    #: runs its rows whole when a projection says this).
    reads_step_rows = True

    def __init__(self, base: torch.nn.Module, parts: list[Part], context: LoRAContext, max_loras: int) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.context = context
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        n, p = max_loras, len(parts)
        self._a_ptr = torch.zeros(n, dtype=torch.int64)
        self._b_ptr = torch.zeros(n, dtype=torch.int64)
        self._rank = torch.zeros(n, dtype=torch.int32)
        self._table = torch.zeros(n, p, 4, dtype=torch.int32)
        self._scales = torch.zeros(n, p, dtype=torch.float32)
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[ModuleDelta, int, int, int, int]]]] = {}
        self._kernel = None
        # the tables' addresses, fixed (they are written in place), in the kernel's order
        self._tables = (self._a_ptr.data_ptr(), self._b_ptr.data_ptr(), self._rank.data_ptr(),
                        self._table.data_ptr(), self._scales.data_ptr(), n, p)
        self._work = 0  # the kernel's work per row (its largest slot's rank x (in + out)), for its grain
        self._device_weights: dict[tuple[int, torch.device], tuple[torch.Tensor, list[tuple]]] = {}

    def extra_repr(self) -> str:
        return f"parts={[part.module.rsplit('.', 1)[-1] for part in self.parts]}, slots={sorted(self._weights)}"

    def set_slot(self, slot: int, deltas: dict[str, ModuleDelta] | None) -> None:
        """Put an adapter's deltas for this layer's parts in ``slot`` (None or none of its
        parts: the slot adds nothing here)."""
        self._weights.pop(slot, None)
        self._device_weights = {k: v for k, v in self._device_weights.items() if k[0] != slot}
        self._a_ptr[slot] = self._b_ptr[slot] = self._rank[slot] = 0
        self._table[slot] = 0
        self._work = int(self._rank.max()) * (self.in_features + self.out_features)
        mine = [(part, deltas[part.module]) for part in self.parts if deltas and part.module in deltas]
        if not mine:
            return
        rank, rows, a_blocks, b_blocks = 0, [], [], []
        for i, part in enumerate(self.parts):
            delta = (deltas or {}).get(part.module)
            r = delta.a.shape[0] if delta is not None else 0
            self._table[slot, i] = torch.tensor([rank, rank + r, part.start, part.stop], dtype=torch.int32)
            self._scales[slot, i] = delta.scale if delta is not None else 0.0
            if delta is not None:
                a_blocks.append(delta.a)
                b_blocks.append(delta.b.t().contiguous().reshape(-1))
                rows.append((delta, rank, rank + r, part.start, part.stop))
            rank += r
        a, b = torch.cat(a_blocks).contiguous(), torch.cat(b_blocks).contiguous()
        self._weights[slot] = (a, b, rows)
        self._a_ptr[slot], self._b_ptr[slot], self._rank[slot] = a.data_ptr(), b.data_ptr(), rank
        self._work = int(self._rank.max()) * (self.in_features + self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = self.context
        if ctx.row_slot is None or ctx.active.isdisjoint(self._weights):
            return y
        if not y.is_cpu:
            self._add_torch(x, y)
        elif y.dtype is torch.float32 and x.dtype is torch.float32 and y.is_contiguous():
            self._add_kernel(x, y.view(-1, self.out_features))
        else:  # 16-bit: the float32 delta, added in the output's dtype
            delta = torch.zeros(y.numel() // self.out_features, self.out_features, dtype=torch.float32)
            self._add_kernel(x.float(), delta)
            y.add_(delta.view(y.shape).to(y.dtype))
        return y

    def _add_kernel(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out [rows, out_features]`` (float32, CPU) += each row's delta (the C kernel)."""
        if self._kernel is None:
            self._kernel = cpu_lora.load_lora().batchgen_lora_f32
        rows = cpu_linear.as_rows(x, self.in_features, "LoRALinear")
        status = self._kernel(rows.data_ptr(), rows.stride(0), out.data_ptr(), out.stride(0), rows.shape[0],
                              self.in_features, self.context.row_slot.data_ptr(), *self._tables, self._work)
        if status != 0:
            raise ValueError(f"LoRALinear: a summed adapter rank above {cpu_lora.max_rank()}")

    def _add_torch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Per adapter, :data:`CHUNK` rows at a time: their delta in float32, added in the
        output's dtype."""
        rows_x = x.reshape(-1, self.in_features)
        out = y.view(-1, self.out_features)
        slots = self.context.slots_on(out.device)
        for slot in sorted(self.context.active.intersection(self._weights)):
            index = (slots == slot).nonzero().flatten()
            a, parts = self._on_device(slot, out.device)
            for start in range(0, index.numel(), CHUNK):
                rows = index[start:start + CHUNK]
                xs = rows_x.index_select(0, rows).float()
                if rows.numel() < CHUNK:
                    xs = torch.nn.functional.pad(xs, (0, 0, 0, CHUNK - rows.numel()))
                t = xs @ a.t()
                for b, scale, r0, r1, c0, c1 in parts:
                    out[rows, c0:c1] += ((t[:, r0:r1] @ b.t()) * scale)[: rows.numel()].to(out.dtype)

    def _on_device(self, slot: int, device: torch.device) -> tuple[torch.Tensor, list[tuple]]:
        """Slot ``slot``'s stacked A and per-part B on ``device`` (copied once per load)."""
        key = (slot, device)
        if key not in self._device_weights:
            a, _b, parts = self._weights[slot]
            self._device_weights[key] = (a.to(device), [(d.b.to(device), d.scale, r0, r1, c0, c1)
                                                        for d, r0, r1, c0, c1 in parts])
        return self._device_weights[key]
