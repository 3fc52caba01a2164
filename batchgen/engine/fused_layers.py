"""The fused layers of the CPU path: :class:`FusedRMSNorm`, :class:`FusedGatedMLP`, and
:func:`merge_linears`, the one rule by which linear layers over one input become one layer
(q/k/v, gate/up), for plain ``nn.Linear`` and GGUF's ``QuantizedLinear`` alike.

Which modules of a model become these, and the probes that decide it, are
:mod:`batchgen.engine.fusion`'s; :class:`~batchgen.engine.fused_attention.FusedAttention` uses
:func:`merge_linears` too. The C ops the layers call are :mod:`batchgen.kernels.cpu.fused`'s.

Numerics of :func:`merge_linears`: each output column of the merged layer is computed exactly as
the layer it comes from computes it, so the merged layer gives the separate layers' bits:

- ``nn.Linear`` of one dtype: their weights stacked and packed as one
  :class:`~batchgen.kernels.cpu.linear.PackedLinear`, whose every output is one chain of
  multiply-adds over the input features, in order, whatever the other columns (the same
  chain a PackedLinear of the single layer runs);
- ``QuantizedLinear`` of one block type: :meth:`QuantizedLinear.concat
  <batchgen.kernels.cpu.quant.QuantizedLinear.concat>` stacks their weight rows; the kernel
  quantizes each input row to int8 per block of the type (the same for every layer of that
  type) and each output depends only on its weight row and that input row;
- layers of several kinds (a Q4_K_M file's Q4_K q and k beside its Q6_K v): each run of
  consecutive layers of one kind is merged as above, and a :class:`ConcatLinear` runs the runs
  and concatenates their outputs along the last dim.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu.linear import DTYPES, PackedLinear
from batchgen.kernels.cpu.quant import QuantizedLinear


def mergeable(layers: Sequence[torch.nn.Module], dtype: torch.dtype) -> bool:
    """Whether :func:`merge_linears` takes ``layers`` in a model computing in ``dtype``: each a
    plain CPU ``nn.Linear`` with a ``dtype`` weight (subclasses may change ``forward``) or a
    ``QuantizedLinear`` (any float input), all of one input width, with a bias on every layer
    or on none."""
    if not layers or dtype not in DTYPES:
        return False
    for layer in layers:
        if type(layer) is torch.nn.Linear:
            if layer.weight.dtype is not dtype or layer.weight.device.type != "cpu":
                return False
        elif not isinstance(layer, QuantizedLinear):
            return False
    first = layers[0]
    return all(layer.in_features == first.in_features and (layer.bias is None) == (first.bias is None)
               for layer in layers)


def _kind(layer: torch.nn.Module) -> tuple:
    """What one GEMM can hold: the weight's dtype, or the block type and the kernel build; and
    the bias presence."""
    stored = (layer.qtype, layer.isa) if isinstance(layer, QuantizedLinear) else layer.weight.dtype
    return type(layer), stored, layer.bias is None


def _merge_run(run: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer for consecutive layers of one kind."""
    first = run[0]
    if isinstance(first, QuantizedLinear):
        return first if len(run) == 1 else QuantizedLinear.concat(run)
    if len(run) == 1:
        return PackedLinear(first)
    both = torch.nn.Linear(first.in_features, sum(layer.out_features for layer in run),
                           bias=first.bias is not None, device="meta")
    both.weight = torch.nn.Parameter(torch.cat([layer.weight.detach() for layer in run]), requires_grad=False)
    if first.bias is not None:
        both.bias = torch.nn.Parameter(torch.cat([layer.bias.detach() for layer in run]), requires_grad=False)
    return PackedLinear(both)


def merge_linears(layers: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One layer whose output is the outputs of ``layers`` side by side along the last dim,
    bit for bit what each gives alone (see the module docstring): a ``PackedLinear``, a
    ``QuantizedLinear``, or a :class:`ConcatLinear` over one of those per run of consecutive
    layers of one kind. One layer is packed (``nn.Linear``) or kept as it is
    (``QuantizedLinear``). The layers themselves are not kept.

    Raises:
        ValueError: layers that :func:`mergeable` refuses for their own dtype.
    """
    layers = list(layers)
    dtype = next((layer.weight.dtype for layer in layers if type(layer) is torch.nn.Linear), torch.float32)
    if not mergeable(layers, dtype):
        raise ValueError("merge_linears needs CPU nn.Linear layers of one dtype the C GEMM runs or "
                         "QuantizedLinear layers, of one input width, with a bias on all or none; got "
                         + ", ".join(type(layer).__name__ for layer in layers))
    runs: list[list[torch.nn.Module]] = []
    for layer in layers:
        if runs and _kind(runs[-1][-1]) == _kind(layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    parts = [_merge_run(run) for run in runs]
    return parts[0] if len(parts) == 1 else ConcatLinear(parts)


class ConcatLinear(torch.nn.Module):
    """Linear layers over one input, run one after the other, their outputs concatenated along
    the last dim (contiguous, so a fused q/k/v output keeps rows of unit column stride)."""

    def __init__(self, parts: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


#: The forms of RMSNorm weight a fused norm is tried in, in order (name, the dtypes it may take,
#: the weight the fused norm multiplies by): Llama's ``weight * x̂`` (16-bit models: x̂ rounded,
#: then the 16-bit product), and Gemma's ``(1 + weight) * x̂``, computed in float32 and rounded
#: once: the fused norm keeps ``1 + weight`` in float32 whatever the model's dtype (fused.c's
#: W_F32; in 16 bits ``1 + w`` would itself be rounded, which Gemma does not do).
NORM_FORMS = (("weight", (torch.float32, torch.bfloat16, torch.float16), lambda w: w),
              ("one_plus_weight", (torch.float32, torch.bfloat16, torch.float16), lambda w: 1.0 + w.float()))


def norm_candidate(module: torch.nn.Module) -> tuple[torch.nn.Parameter, float] | None:
    """``(weight, eps)`` if ``module`` looks like an RMSNorm (a ``*RMSNorm`` with a 1-D CPU
    weight the C ops run and a float ``variance_epsilon`` or ``eps``); which form it computes is
    left to the fusion probe (:meth:`FusedRMSNorm.forms`)."""
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1
            or not cpu_fused.supported(weight.dtype) or weight.device.type != "cpu"
            or not weight.is_contiguous() or not isinstance(eps, float)):
        return None
    return weight, eps


class FusedRMSNorm(torch.nn.Module):
    """An RMSNorm (``weight * x / sqrt(mean(x²) + eps)``) in one C pass
    (:func:`~batchgen.kernels.cpu.fused.rms_norm`); keeps the weight it multiplies by (for
    Gemma's norms, ``1 + w``: :data:`NORM_FORMS`)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    @classmethod
    def forms(cls, weight: torch.nn.Parameter, eps: float) -> Iterator["FusedRMSNorm"]:
        """A fused norm for each of :data:`NORM_FORMS` that takes ``weight``'s dtype, in order."""
        for _, dtypes, scale in NORM_FORMS:
            if weight.dtype in dtypes:
                with torch.no_grad():
                    yield cls(torch.nn.Parameter(scale(weight.detach()), requires_grad=False), eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_fused.rms_norm(x, self.weight, self.variance_epsilon)


#: The most bytes of gate/up output a :class:`FusedGatedMLP` holds at once: a prefill chunk's
#: rows go through it a slice at a time. 16 MiB stays below glibc's largest mmap threshold
#: (32 MiB), so each slice's buffers are reused from the heap instead of mapped and faulted in
#: afresh: on the Qwen2.5-1.5B-shaped Q4_K_M file 2,048 rows took 395 ms a layer in slices of
#: 64-384 rows against 670-930 ms whole, and the whole rows' gate/up and SiLU·up outputs are
#: 210 MiB (``docs/gguf.md``, "Memory").
SLICE_BYTES = 16 * 2**20


def activation_of(act: Any) -> str | None:
    """The :data:`~batchgen.kernels.cpu.fused.ACTIVATIONS` row that the module's activation
    ``act`` computes (told by its values on a probe range, not by its name: HF spells SiLU and
    GELU-tanh several ways), or None for another function."""
    probe = torch.linspace(-10.0, 10.0, 201)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001 - not a plain element-wise function of one tensor
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    return next((name for name, (_, fn) in cpu_fused.ACTIVATIONS.items()
                 if torch.allclose(got, fn(probe), rtol=1e-6, atol=1e-7)), None)


class FusedGatedMLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))``: gate and up as one layer (:func:`merge_linears`; Phi-3's
    ``gate_up_proj`` already is one, the gate first), the fused act·up
    (:func:`~batchgen.kernels.cpu.fused.gated_mul`: SiLU, or Gemma's GELU-tanh), then the down
    projection (packed, or kept quantized). The layers given are not kept.

    Many rows (a prefill chunk) go through in slices of :attr:`slice_rows` rows (whole panels
    of 16, :data:`SLICE_BYTES` of gate/up output): each row's result is the same bits either
    way (every kernel computes a row from that row alone), with a fraction of the memory. A
    projection that reads the step's rows by position (``reads_step_rows``: a LoRA layer,
    whose adapter slots index the step's rows) gets them whole.

    Args:
        gate_up: the gate and up layers, or the one layer holding both (gate first).
        down: the down projection.
        names: the projections ``gate_up`` holds, for :meth:`merged_projections`.
        activation: the :data:`~batchgen.kernels.cpu.fused.ACTIVATIONS` row of the gate.
    """

    def __init__(self, gate_up: Sequence[torch.nn.Module], down: torch.nn.Module,
                 names: tuple[str, ...] = ("gate_proj", "up_proj"), activation: str | None = "silu") -> None:
        super().__init__()
        if activation not in cpu_fused.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; known: {', '.join(cpu_fused.ACTIVATIONS)}")
        self.gate_up_proj = merge_linears(gate_up)
        self.down_proj = merge_linears([down])
        self._names = names
        self.activation = activation

    @classmethod
    def of(cls, module: torch.nn.Module) -> "FusedGatedMLP":
        """The fused MLP of a module :func:`mlp_candidate` takes (an activation of no
        :data:`~batchgen.kernels.cpu.fused.ACTIVATIONS` row is refused, not taken for SiLU)."""
        if hasattr(module, "gate_up_proj"):
            return cls([module.gate_up_proj], module.down_proj, ("gate_up_proj",), activation_of(module.activation_fn))
        return cls([module.gate_proj, module.up_proj], module.down_proj, activation=activation_of(module.act_fn))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"

    def slice_rows(self, element_size: int = 4) -> int:
        """Rows per slice: :data:`SLICE_BYTES` of gate/up output in elements of
        ``element_size`` bytes, in whole panels of 16 rows (at least one)."""
        rows = SLICE_BYTES // (element_size * self.gate_up_proj.out_features)
        return max(16, rows // 16 * 16)

    def merged_projections(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        """The merged linear's name and the projections it holds, in order, with their output
        widths: what a LoRA adapter of gate/up targets in it (:mod:`batchgen.lora.layers`)."""
        width = self.gate_up_proj.out_features // len(self._names)
        return "gate_up_proj", tuple((name, width) for name in self._names)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_fused.gated_mul(self.gate_up_proj(x), self.activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.slice_rows(x.element_size())
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= step or any(getattr(p, "reads_step_rows", False)
                                        for p in (self.gate_up_proj, self.down_proj)):
            return self._whole(x)
        first = self._whole(rows[:step])
        out = first.new_empty(rows.shape[0], first.shape[-1])
        out[:step] = first
        del first
        for start in range(step, rows.shape[0], step):
            out[start:start + step] = self._whole(rows[start:start + step])
        return out.view(*x.shape[:-1], out.shape[-1])


def mlp_candidate(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether :meth:`FusedGatedMLP.of` takes ``module``: ``gate_proj``/``up_proj``/``down_proj``
    and an ``act_fn`` (Llama), or ``gate_up_proj``/``down_proj`` and an ``activation_fn``
    (Phi-3: gate then up in one linear), the activation one of
    :data:`~batchgen.kernels.cpu.fused.ACTIVATIONS` (:func:`activation_of`); linears that merge
    and widths that fit (the order of gate and up is left to the fusion probe)."""
    down = getattr(module, "down_proj", None)
    if hasattr(module, "gate_up_proj"):
        gate_up = module.gate_up_proj
        return (activation_of(getattr(module, "activation_fn", None)) is not None and mergeable([gate_up], dtype)
                and mergeable([down], dtype) and gate_up.out_features == 2 * down.in_features)
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj")]
    if activation_of(getattr(module, "act_fn", None)) is None or not all(mergeable([p], dtype) for p in (*parts, down)):
        return False
    gate, up = parts
    return mergeable([gate, up], dtype) and gate.out_features == up.out_features == down.in_features
