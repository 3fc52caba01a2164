"""DecoderProgram: a decode step's decoder layers run by one C call (``kernels/cpu/decoder.c``)
instead of nine Python calls a layer.

Why: at batch 1 a decode step is the weights streaming once through the linear kernels; on
the 1B Llama-shaped Q4_K file (2 threads, Zen 4) the kernels of a layer took about 1.2 ms and
the Python between them (the fused layers' calls through ctypes, their checks and
temporaries) 0.25 ms more, a fifth of the step, because the streaming weights evict the
interpreter's lines between two calls. The program calls the same kernels with the same
arguments in the same order, so a step's logits and K/V are the Python layers' bits
(``tests/gguf/test_decoder_program.py`` checks greedy tokens and logprobs with and without it).

Which models: a decoder whose layers all are
:class:`~batchgen.engine.fused_decoder.FusedDecoderLayer` (so its forward is a
:class:`~batchgen.engine.fused_decoder.LeanDecoderForward`), attending with the ``cpu``
backend, each layer's projections :class:`~batchgen.kernels.cpu.linear.PackedLinear` of the
model's dtype (float32, or bfloat16 / float16 where the build has the fused ops' 16-bit entry
points) or, in float32, :class:`~batchgen.kernels.cpu.quant.QuantizedLinear` (or a
ConcatLinear of them: a Q4_K_M file's mixed q/k/v), per-head q/k norms (Qwen3, Gemma 3) only
as fused RMSNorms, and no LoRA (whose layers read the step's rows by position). Either layer
form of :data:`~batchgen.engine.fused_decoder.LAYER_FORMS` (Gemma's sandwich norms too, their
``1 + w`` weights in float32 in a 16-bit model: the layer's norms all of one weight dtype), any
activation of :data:`~batchgen.kernels.cpu.fused.ACTIVATIONS`, and up to four rotary tables
(Gemma 3's local and global RoPE), each layer rotating by its own. :func:`install` builds it
once, after the model's layers are final (the runner calls it after LoRA's wrapping); anything
else keeps the Python layers.

Which steps: steps whose every row is a decode (one query per sequence), at most
:attr:`DecoderProgram.max_rows` rows (the MLP's slice: the Python MLP would split more rows),
with no probe watching (``metadata.seen``). Prefill chunks keep the Python layers: their
kernels run for milliseconds, and the calls between cost nothing next to them.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engine.fused_attention import FusedAttention
from batchgen.engine.fused_decoder import FusedDecoderLayer, LeanDecoderForward
from batchgen.engine.fused_layers import ConcatLinear, FusedGatedMLP, FusedRMSNorm
from batchgen.engine.paged_attention import AttentionMetadata
from batchgen.kernels.cpu import c_build, cpu_attention
from batchgen.kernels.cpu import decoder as cdecoder
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu.linear import DTYPES


def _parts(module: torch.nn.Module) -> list[torch.nn.Module]:
    return list(module.parts) if type(module) is ConcatLinear else [module]


def _norm(norm: torch.nn.Module, width: int, dtype: torch.dtype) -> tuple[int, float, bool] | None:
    """A fused norm's ``(weight address, eps, float32 weight in a 16-bit model)``, or None where
    its weight is not ``width`` wide, contiguous, and of ``dtype`` or (16-bit models: Gemma's
    ``1 + w``, ``fused_layers.NORM_FORMS``) float32."""
    w = norm.weight
    w32 = dtype is not torch.float32 and w.dtype is torch.float32
    if (w.dtype is not dtype and not w32) or w.shape != (width,) or not w.is_contiguous():
        return None
    return w.data_ptr(), norm.variance_epsilon, w32


def _norms(layer: FusedDecoderLayer, hidden: int, dtype: torch.dtype) -> dict[str, tuple | None] | None:
    """Each norm role's :func:`_norm` (``(None, 0.0, None)`` where the form lacks it), or None
    where one is not a fused norm of this width and dtype."""
    found: dict[str, tuple | None] = {}
    for role in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"):
        norm = layer.role(role)
        found[role] = (None, 0.0, None) if norm is None and role.endswith("out_norm") else (
            _norm(norm, hidden, dtype) if type(norm) is FusedRMSNorm else None)
    return None if None in found.values() else found


def _layer(layer: FusedDecoderLayer, rope: int, kernels: dict, dtype: torch.dtype) -> cdecoder.Layer | None:
    """The C layer of ``layer`` (rotating by the step's table ``rope``), or None where the
    program cannot run it as the Python layer runs."""
    attn, mlp = layer.role("attn"), layer.role("mlp")
    if type(mlp) is not FusedGatedMLP or type(attn) is not FusedAttention:
        return None
    d, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    linears = [cdecoder.linear(_parts(m), kernels, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                   mlp.down_proj)]
    if any(lin is None for lin in linears):
        return None
    qkv, o, gate_up, down = linears
    hidden = qkv.k
    norms = _norms(layer, hidden, dtype)
    head_norms = (None, 0.0, None), (None, 0.0, None)
    if attn.qk_norms:
        head_norms = tuple(_norm(n, d, dtype) if type(n) is FusedRMSNorm else None for n in (attn.q_norm, attn.k_norm))
    shapes_fit = (qkv.n == (heads + 2 * kv) * d and o.k == heads * d and o.n == hidden and gate_up.k == hidden
                  and gate_up.n % 2 == 0 and down.k == gate_up.n // 2 and down.n == hidden)
    if norms is None or None in head_norms or not shapes_fit:
        return None
    w32 = {n[2] for n in (*norms.values(), *head_norms) if n[2] is not None}
    if len(w32) > 1:  # one weight dtype for all the layer's norms (struct bg_layer's norm_flags)
        return None
    options = attn.options
    return cdecoder.Layer(norm1=norms["attn_norm"][0], norm2=norms["mlp_norm"][0], eps1=norms["attn_norm"][1],
                          eps2=norms["mlp_norm"][1], q_norm=head_norms[0][0], k_norm=head_norms[1][0],
                          q_eps=head_norms[0][1], k_eps=head_norms[1][1], attn_out_norm=norms["attn_out_norm"][0],
                          mlp_out_norm=norms["mlp_out_norm"][0], attn_out_eps=norms["attn_out_norm"][1],
                          mlp_out_eps=norms["mlp_out_norm"][1], act=cpu_fused.ACTIVATIONS[mlp.activation][0],
                          rope=rope, qkv=qkv, o=o, gate_up=gate_up, down=down, heads=heads, kv_heads=kv,
                          head_dim=d, scale=options.scale, soft_cap=options.logits_soft_cap or 0.0,
                          window=options.sliding_window or 0,
                          norm_flags=cpu_fused.W_F32 if w32 == {True} else 0)


class DecoderProgram:
    """The C layers of one decoder, and the step's call (:meth:`run`)."""

    def __init__(self, lib: Any, entry: cdecoder.Entry, layers: list[cdecoder.Layer], indices: list[int],
                 max_rows: int, dtype: torch.dtype = torch.float32) -> None:
        self.lib, self.entry, self.dtype = lib, entry, dtype
        self.layers = (cdecoder.Layer * len(layers))(*layers)
        self.indices = indices
        self.max_rows = max_rows
        self._cache_ptr = None
        self._step = cdecoder.Step(dtype=DTYPES[dtype])
        self._has_16 = bool(entry.rms_norm_16)  # the fused ops' 16-bit build: a 16-bit cache's conversions too

    @classmethod
    def build(cls, decoder: torch.nn.Module, dtype: torch.dtype) -> tuple[DecoderProgram | None, str]:
        """The program of ``decoder`` (``model.model``, whose forward is a
        :class:`~batchgen.engine.fused_decoder.LeanDecoderForward`) computing in ``dtype``, or
        None and why not."""
        layers = list(decoder.layers)
        ropes = decoder.forward.layer_rope
        if len(decoder.forward.rope_keys) > cdecoder.MAX_ROPES:
            return None, f"more than {cdecoder.MAX_ROPES} rotary tables"
        if not layers or not all(type(layer) is FusedDecoderLayer for layer in layers):
            return None, "not every decoder layer is fused"
        if dtype not in DTYPES or (dtype is not torch.float32 and not cpu_fused.load_fused().batchgen_fused_has_16()):
            return None, f"{dtype} rows, which this build's fused ops do not run"
        kernels: dict = {}
        built = [_layer(layer, rope, kernels, dtype) for layer, rope in zip(layers, ropes)]
        if any(c is None for c in built):
            return None, "a layer the program does not run (LoRA, or a linear or norm of another kind)"
        attns = [layer.role("attn") for layer in layers]
        first = attns[0]
        if any(a.head_dim != first.head_dim or a.num_heads // a.num_kv_heads != first.num_heads // first.num_kv_heads
               for a in attns):
            return None, "layers of several attention shapes"
        try:
            lib = cdecoder.load()
            entry = cdecoder.entry(kernels, first.head_dim, first.num_heads // first.num_kv_heads)
        except (c_build.CpuKernelError, RuntimeError) as exc:
            return None, str(exc).splitlines()[0]
        max_rows = min(layer.role("mlp").slice_rows(dtype.itemsize) for layer in layers)
        return cls(lib, entry, built, [a.layer_idx for a in attns], max_rows, dtype), ""

    def _bind_cache(self, meta: AttentionMetadata) -> None:
        """Each layer's K/V pools, whenever the cache is another tensor than the last step's."""
        ptr = meta.kv_cache.data_ptr()
        if ptr == self._cache_ptr:
            return
        for layer, index in zip(self.layers, self.indices):
            k, v = meta.layer_pools(index)
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.num_blocks, layer.block_size = k.shape[0], k.shape[1]
            layer.kv_dtype = DTYPES[k.dtype]
        self._cache_ptr = ptr

    def runs(self, hidden: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> bool:
        """Whether :meth:`run` takes this step (see the module docstring); ``tables``: the step's
        cos/sin, one pair per rotary table (:class:`~batchgen.engine.fused_decoder.LeanDecoderForward`)."""
        m = hidden.shape[-2]
        return (meta.num_decode_tokens == m and 0 < m <= self.max_rows and meta.seen is None
                and hidden.dtype is self.dtype and hidden.is_contiguous()
                and all(t.dtype is self.dtype and t.is_contiguous() and t.shape[-1] == tables[0][0].shape[-1]
                        for pair in tables for t in pair)
                and meta.kv_cache.is_contiguous()
                and (meta.kv_cache.dtype is torch.float32 or self._has_16)
                and meta.slot_mapping.dtype is torch.int64 and meta.slot_mapping.is_contiguous())

    def run(self, hidden: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> None:
        """Every layer over ``hidden`` (``[1, m, H]``, updated in place) for a step :meth:`runs`
        takes, with the step's cos/sin ``tables``.

        Raises:
            ValueError: a kernel refused its arguments (as the Python layer's would).
            MemoryError: no memory for a scratch buffer.
        """
        self._bind_cache(meta)
        blocks = cpu_attention.as_int32(meta.decode_block_tables)
        lens = cpu_attention.as_int32(meta.decode_context_lens)
        step = self._step
        step.m = hidden.shape[-2]
        for i, (cos, sin) in enumerate(tables):
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        step.ldc = step.lds = tables[0][0].shape[-1]
        step.slots, step.tables, step.lens = meta.slot_mapping.data_ptr(), blocks.data_ptr(), lens.data_ptr()
        step.max_blocks = blocks.shape[1]
        status, where, layer = cdecoder.run(self.lib, self.entry, self.layers, step, hidden)
        if status:
            raise self._error(status, where, layer)

    def _error(self, status: int, where: int, index: int) -> Exception:
        """The error of a kernel's refusal, worded as the Python layer's call would word it."""
        layer = self.layers[index]
        what = f"decoder layer {self.indices[index]}: {cdecoder.WHERE.get(where, 'a kernel')}"
        if where == cdecoder.AT_MEMORY or (where < cdecoder.AT_ROPE and status == -1):  # a linear layer's
            return MemoryError(f"{what} found no memory")
        detail = f"code {status}"
        if where == cdecoder.AT_ROPE:
            detail = f"slots must lie in [0, {layer.num_blocks * layer.block_size})"
        elif where == cdecoder.AT_ATTENTION and status in cpu_attention.ERRORS:
            detail = cpu_attention.ERRORS[status].format(width=self._step.max_blocks * layer.block_size,
                                                         num_blocks=layer.num_blocks)
        return ValueError(f"{what} refused its arguments: {detail}")


def install(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """Hands ``model``'s decoder a :class:`DecoderProgram` where it can run one (its
    :class:`~batchgen.engine.fused_decoder.LeanDecoderForward` then runs decode steps through
    it); returns what was done, for the load log."""
    decoder = getattr(model, "model", None)
    forward = getattr(decoder, "forward", None)
    if not isinstance(forward, LeanDecoderForward):
        return "decoder program: no (the decoder's layers are not all fused)"
    program, why = DecoderProgram.build(decoder, dtype)
    forward.program = program
    return f"decoder program: {len(program.layers)} layers" if program else f"decoder program: no ({why})"
