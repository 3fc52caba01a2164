"""The model's fusion on the CPU path: which of its layers are replaced by fused ones, and why.

:func:`fuse_model` runs once per model, when ``linear_backend="cpu"`` (the model runner calls it
before :func:`~batchgen.kernels.cpu.linear.pack_linears` packs the linear layers left). In a
float32, bfloat16 or float16 CPU model it replaces

- each RMSNorm (a module named ``*RMSNorm`` with a 1-D ``weight`` and ``variance_epsilon`` or
  ``eps``; Llama's ``weight * x̂`` or, in float32, Gemma's ``(1 + weight) * x̂``:
  :data:`~batchgen.engine.fused_layers.NORM_FORMS`) by a
  :class:`~batchgen.engine.fused_layers.FusedRMSNorm` (one C pass instead of six torch ops);
- each gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn``, or Phi-3's
  ``gate_up_proj``, ``down_proj`` and ``activation_fn``; SiLU or Gemma's GELU-tanh) by a
  :class:`~batchgen.engine.fused_layers.FusedGatedMLP`: gate and up as one GEMM, then the fused
  act·up;
- each HF Llama-like attention layer (``q_proj``/``k_proj``/``v_proj``/``o_proj``, or Phi-3's
  one ``qkv_proj``; ``head_dim``, ``layer_idx``, ``scaling``; a model with one rotary embedding
  over the whole head) by a :class:`~batchgen.engine.fused_attention.FusedAttention`: q/k/v as one GEMM, RoPE
  and the KV-cache write in one C pass, then the paged attention;
- then each decoder layer whose parts (two norms, attention, MLP; Gemma's two more norms around
  the attention's and the MLP's outputs) all fused by a
  :class:`~batchgen.engine.fused_decoder.FusedDecoderLayer`: one lean forward instead of HF's,
  the residual add and the second norm in one C pass; and where every layer is one, the
  decoder's forward for the engine's steps by a
  :class:`~batchgen.engine.fused_decoder.LeanDecoderForward` (no mask building, no wrappers).

Why: in a decode step of a small model each of these is a chain of narrow torch ops over a few
dozen rows whose dispatch costs more than their arithmetic (figures in ``docs/kernels.md``).

The linear layers of a candidate may be plain CPU ``nn.Linear`` (packed for the C GEMM) or GGUF
``QuantizedLinear`` (``quantization="gguf"``, kept quantized); the one rule that merges q/k/v or
gate/up, for both, is :func:`~batchgen.engine.fused_layers.merge_linears`, which gives the
separate layers' bits. Modules are recognised by their attributes, then **checked**: a
candidate is replaced only if the fused layer reproduces the module's own output on a probe
input (norms and MLPs: random rows; attention: hidden states with the model's own rotary
``cos``/``sin``, a mixed decode + prefill step over a small probe cache, the original run
through batchgen's attention interface, its output and the K/V it writes compared; decoder
layers: the same attention probe, output and K/V equal bit for bit; the decoder: the model's
logits and K/V over that step through every layer, bit for bit). A variant
of other semantics (another activation, partial or interleaved rotary) fails the probe and
stays as it is. Per-head q/k norms (Qwen3, Gemma 3) are kept and run
by the fused layer; the layer's scale, sliding window and soft cap are what the original passed
to the attention interface on the probe; a rotary embedding with per-layer-type tables (Gemma
3's local and global RoPE) gives each layer's probe its own layer type's cos/sin.

Numerics: RMSNorm and act·up equal torch's within float32 rounding, or one unit in the last
place of a 16-bit type (:mod:`batchgen.kernels.cpu.fused`); the fused attention computes what
the unfused layer does on the CPU path bit for bit, and merging linears changes no bit.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable

import torch

from batchgen.engine import fused_decoder, paged_attention
from batchgen.engine.fused_attention import FusedAttention, attention_candidate, attention_heads
from batchgen.engine.fused_decoder import FusedDecoderLayer, LeanDecoderForward
from batchgen.engine.fused_layers import FusedGatedMLP, FusedRMSNorm, mlp_candidate, norm_candidate
from batchgen.gguf.hf_model import release_freed_memory
from batchgen.kernels import torch_attention
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu.quant import QuantizedLinear

logger = logging.getLogger(__name__)

#: The kinds of fusion, in the keys of :func:`fuse_model`'s counts.
KINDS = ("rms_norm", "gated_mlp", "attention", "decoder_layer", "decoder")

PROBE_ROWS = 5
# How far a fused norm or MLP may be from the module it replaces on the probe, relative to the
# output's scale: float32 rounding, or about two units in the last place of a 16-bit type.
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Where a GGUF layer quantizes the fused op's output to int8 (an MLP's down projection), the
# absolute tolerance, relative to the output's largest magnitude: an activation one float32
# rounding off can land on the other side of an int8 step, which moves the output by about one
# step of one input in k (3.7e-4 of the scale, once in the 26 MLPs of the Gemma-2-2B-shaped
# Q4_K_M file); another semantics is off by the order of the values.
PROBE_RTOL_QUANTIZED = 2e-3
# The attention probe step: block size 4; one decode (context 6: five cached tokens, then the
# new one) and one prefill chunk of 4 tokens after 2 cached ones (context 6).
PROBE_BLOCK_SIZE = 4
PROBE_NUM_BLOCKS = 4
PROBE_POSITIONS = (5, 2, 3, 4, 5)
PROBE_SLOTS = (5, 10, 11, 12, 13)
# How far the fused attention's output and K/V may be from the original's on the probe,
# relative to the largest magnitude: the packed GEMM's rounding, amplified by the softmax
# (measured on SmolLM2: 2.6e-5 in float32, 2.2e-3 in bfloat16, 5.2e-4 in float16). Another
# semantics (a per-head norm, another rotary) is off by the order of the values themselves.
PROBE_TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype the model computes in: that of its first floating-point parameter (a GGUF
    model's quantized weights are buffers; its norms are parameters), or None."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _fused_norm(module: torch.nn.Module, weight: torch.nn.Parameter, eps: float) -> FusedRMSNorm | None:
    """The first of the fused norms of ``weight``'s forms
    (:data:`~batchgen.engine.fused_layers.NORM_FORMS`) that reproduces ``module`` on the probe,
    or None."""
    for fused in FusedRMSNorm.forms(weight, eps):
        if _reproduces(module, fused, weight.shape[0], weight.dtype):
            return fused
    return None


def _reproduces(original: torch.nn.Module, fused: torch.nn.Module, width: int, dtype: torch.dtype) -> bool:
    """Whether the fused norm or MLP gives ``original``'s output on a probe input (rounding
    aside)."""
    gen = torch.Generator().manual_seed(0)
    probe = (torch.randn(1, PROBE_ROWS, width, generator=gen) * 2.0).to(dtype)
    with torch.no_grad():
        want = original(probe)
        got = fused(probe)
    if not isinstance(want, torch.Tensor) or want.shape != got.shape or want.dtype != got.dtype:
        return False
    rtol = PROBE_RTOL[dtype]
    want, got = want.float(), got.float()
    scale = float(want.abs().max())
    atol = rtol * 0.1 * scale + 1e-6
    if any(isinstance(m, QuantizedLinear) for m in fused.modules()):
        atol = max(atol, PROBE_RTOL_QUANTIZED * scale)
    return bool(torch.allclose(got, want, rtol=rtol, atol=atol))


def _rotary_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's one rotary embedding module (HF's ``*RotaryEmbedding``), or None when it has
    none or several (local and global ones: which layer uses which is the model's business)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    return found[0] if len(found) == 1 else None


def _full_rotary(config: Any) -> bool:
    """Whether the config rotates the whole head (no ``partial_rotary_factor`` below 1)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    factor = getattr(text, "partial_rotary_factor", None)
    rope = getattr(text, "rope_parameters", None)
    if factor is None and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
    return factor is None or float(factor) == 1.0


def _cos_sin(rotary: torch.nn.Module, hidden_states: torch.Tensor, positions: torch.Tensor,
             layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's cos/sin at ``positions``: for ``layer_type``'s table where the
    embedding keeps one per layer type (its ``forward`` takes a ``layer_type``: Gemma 3)."""
    with torch.no_grad():
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(hidden_states, positions, layer_type)
        return rotary(hidden_states, positions)


class _Probe:
    """The attention probe step: hidden states, the model's cos/sin at the probe positions (of
    the probed layers' type), a probe cache (filled with the same random values before each
    run) and its metadata."""

    def __init__(self, rotary: torch.nn.Module, hidden: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, layer_type: str | None = None) -> None:
        gen = torch.Generator().manual_seed(0)
        tokens = len(PROBE_POSITIONS)
        self.hidden_states = (torch.randn(1, tokens, hidden, generator=gen) * 2.0).to(dtype)
        positions = torch.tensor([PROBE_POSITIONS])
        self.cos, self.sin = _cos_sin(rotary, self.hidden_states, positions, layer_type)
        self.position_ids = positions
        shape = (num_layers, 2, PROBE_NUM_BLOCKS, PROBE_BLOCK_SIZE, num_kv_heads, head_dim)
        self.initial = torch.randn(shape, generator=gen).to(dtype)
        self.meta = paged_attention.AttentionMetadata(
            kv_cache=self.initial.clone(),
            slot_mapping=torch.tensor(PROBE_SLOTS, dtype=torch.int64),
            num_decode_tokens=1,
            decode_block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
            decode_context_lens=torch.tensor([6], dtype=torch.int32),
            prefill_block_tables=torch.tensor([[2, 3]], dtype=torch.int32),
            prefill_query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
            prefill_context_lens=torch.tensor([6], dtype=torch.int32),
            ops=torch_attention.get_torch_ops(),
            workspace=torch_attention.Workspace(),
        )

    def run(self, module: torch.nn.Module, layer: int) -> tuple[Any, torch.Tensor]:
        """``module``'s output and the K/V it left in layer ``layer``'s probe cache; what it
        passed to the attention interface is left in ``self.meta.seen``."""
        self.meta.kv_cache.copy_(self.initial)
        self.meta.seen = {}
        with torch.no_grad():
            out = module(hidden_states=self.hidden_states, attention_mask=None, position_ids=self.position_ids,
                         cache=None, use_cache=False, position_embeddings=(self.cos, self.sin),
                         batchgen_metadata=self.meta)
        return out, self.meta.kv_cache[layer].clone()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``got`` is ``want`` within ``PROBE_TOL[dtype]`` of ``want``'s largest magnitude."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    got, want = got.float(), want.float()
    return bool((got - want).abs().max() <= PROBE_TOL[dtype] * want.abs().max() + 1e-6)


def _fused_attention(original: torch.nn.Module, probe: _Probe, dtype: torch.dtype) -> tuple[FusedAttention | None, bool]:
    """The fused layer for ``original`` (None if the probe cannot run it), with the options
    ``original`` passed to the attention interface on the probe, and whether it gives
    ``original``'s output and K/V there (rounding aside)."""
    layer = original.layer_idx
    try:
        want, want_cache = probe.run(original, layer)
        options = probe.meta.seen.get(layer)
        if options is None or not isinstance(want, tuple) or not isinstance(want[0], torch.Tensor):
            return None, False  # it did not attend through the paged attention
        fused = FusedAttention(original, options)
        got, got_cache = probe.run(fused, layer)
    except Exception as exc:  # noqa: BLE001 - a layer that cannot take the probe is not replaced
        # e.g. cos/sin narrower than the head (partial rotary), or a layer of another kind
        logger.debug("the attention probe failed: %s", exc)
        return None, False
    return fused, _close(got[0], want[0], dtype) and _close(got_cache, want_cache, dtype)


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module, fused: torch.nn.Module | None,
             ok: bool, kind: str, counts: dict[str, int]) -> None:
    """Put ``fused`` in ``module``'s place if the probe said ``ok``; count either way."""
    if not ok:
        counts["rejected"] += 1
        logger.info("%s (%s) left unfused: the fused %s does not reproduce it", name, type(module).__name__, kind)
        return
    model.set_submodule(name, fused)
    counts[kind] += 1
    if kind != "decoder_layer" and any(isinstance(m, QuantizedLinear) for m in fused.modules()):
        # a merge's transient copies of GGUF blocks: handed back at once, so the peak stays
        # near the weights' bytes (float layers are packed later, by pack_linears)
        release_freed_memory()


def _modules(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """``model.named_modules()``, each looked up when its turn comes: a module replaced
    meanwhile (or inside a replaced one) is skipped, and no list keeps a replaced layer, and
    its weights, alive until the walk ends."""
    for name in [n for n, _ in model.named_modules()]:
        try:
            yield name, model.get_submodule(name)
        except AttributeError:
            continue


def _fuse_attention(model: torch.nn.Module, dtype: torch.dtype, counts: dict[str, int]) -> dict[int, _Probe]:
    """Fuse the attention layers that pass the probe; the probe of each candidate's layer index
    (the decoder layers' probe, :func:`_fuse_decoder_layers`)."""
    candidates = [name for name, m in model.named_modules() if attention_candidate(m, dtype)]
    if not candidates:
        return {}
    rotary = _rotary_embedding(model)
    if rotary is None or not _full_rotary(model.config):
        counts["rejected"] += len(candidates)
        logger.info("%d attention layers left unfused: the model's rotary embedding is not one "
                    "full-head rotate-half", len(candidates))
        return {}
    probes: dict[tuple[int, int, int, Any], _Probe] = {}
    by_layer: dict[int, _Probe] = {}
    num_layers = 1 + max(model.get_submodule(name).layer_idx for name in candidates)
    for name in candidates:
        module = model.get_submodule(name)
        head_dim = int(module.head_dim)
        layer_type = getattr(module, "layer_type", None)
        key = (module.o_proj.out_features, attention_heads(module)[1], head_dim, layer_type)
        if key not in probes:
            probes[key] = _Probe(rotary, key[0], num_layers, key[1], head_dim, dtype, layer_type)
        by_layer[module.layer_idx] = probes[key]
        fused, ok = _fused_attention(module, probes[key], dtype)
        _replace(model, name, module, fused, ok, "attention", counts)
    return by_layer


def _same_layer(original: torch.nn.Module, fused: torch.nn.Module, probe: _Probe, layer: int) -> bool:
    """Whether ``fused`` gives ``original``'s output and K/V on the probe, bit for bit."""
    try:
        want, want_cache = probe.run(original, layer)
        got, got_cache = probe.run(fused, layer)
    except Exception as exc:  # noqa: BLE001 - a layer that cannot take the probe is not replaced
        logger.debug("the decoder-layer probe failed: %s", exc)
        return False
    return (isinstance(want, torch.Tensor) and want.shape == got.shape and want.dtype == got.dtype
            and torch.equal(got, want) and torch.equal(got_cache, want_cache))


def _fuse_decoder_layers(model: torch.nn.Module, probes: dict[int, _Probe], counts: dict[str, int]) -> None:
    """Replace each decoder layer whose parts are all fused (:func:`fused_decoder.candidate`)
    by a :class:`FusedDecoderLayer` where the attention probe of its layer shows it exact."""
    for name, module in _modules(model):
        if not fused_decoder.candidate(module):
            continue
        layer = module.self_attn.layer_idx
        probe = probes.get(layer)
        if probe is None:  # its attention was fused by an earlier call: no probe of its layer here
            continue
        fused = FusedDecoderLayer(module)
        _replace(model, name, module, fused, _same_layer(module, fused, probe, layer), "decoder_layer", counts)


def _decoder_probe_run(model: torch.nn.Module, probe: _Probe, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits at the probe step's tokens and the K/V it left in every layer."""
    probe.meta.kv_cache.copy_(probe.initial)
    probe.meta.seen = {}
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=probe.position_ids, use_cache=False, batchgen_metadata=probe.meta)
    return out.logits, probe.meta.kv_cache.clone()


def _fuse_decoder(model: torch.nn.Module, probes: dict[int, _Probe], counts: dict[str, int]) -> None:
    """Install a :class:`LeanDecoderForward` on the model's decoder where its layers all fused
    and, on one probe step over every layer, the model's logits and K/V stay HF's bit for bit."""
    decoder = getattr(model, "model", None)
    if (not fused_decoder.lean_candidate(decoder) or len({p.initial.shape for p in probes.values()}) != 1
            or set(probes) != set(range(len(decoder.layers)))):
        return  # not the plain stack, or its layers' caches differ: the probe cache holds one shape
    probe = probes[0]  # any layer's: the model computes each layer type's cos/sin itself
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(decoder.embed_tokens.num_embeddings, (1, len(PROBE_POSITIONS)), generator=gen)
    try:
        want = _decoder_probe_run(model, probe, ids)
        decoder.forward = LeanDecoderForward(decoder)
        got = _decoder_probe_run(model, probe, ids)
        ok = all(torch.equal(g, w) for g, w in zip(got, want))
    except Exception as exc:  # noqa: BLE001 - a model that cannot take the probe keeps HF's forward
        logger.debug("the decoder probe failed: %s", exc)
        ok = False
    if not ok:
        vars(decoder).pop("forward", None)
        logger.info("the decoder's lean forward does not reproduce HF's: left as it was")
    counts["decoder" if ok else "rejected"] += 1


def fuse_model(model: torch.nn.Module, kinds: Iterable[str] = KINDS) -> dict[str, int]:
    """Replace the RMSNorms, gated MLPs, attention layers and then decoder layers of a float32,
    bfloat16 or float16 CPU ``model`` (loaded with batchgen's attention, ``attn_implementation="batchgen_paged"``)
    by fused ones where the probe shows them equal (see the module docstring). The replaced
    layers' weights are dropped once merged. Call before
    :func:`~batchgen.kernels.cpu.linear.pack_linears`, which packs the linears left.

    Args:
        kinds: which of :data:`KINDS` to fuse (the others stay as they are).

    Returns:
        ``{"rms_norm": fused norms, "gated_mlp": fused MLPs, "attention": fused attention
        layers, "decoder_layer": decoder layers run by one lean forward, "decoder": 1 where the
        decoder stack runs the engine's steps by a lean forward, "rejected": candidates that failed
        the probe}``.

    Raises:
        ValueError: a kind not in :data:`KINDS`.
        batchgen.kernels.cpu.CpuKernelError: the fused ops' library cannot be built here.
    """
    kinds = set(kinds)
    if kinds - set(KINDS):
        raise ValueError(f"unknown fusion kinds {sorted(kinds - set(KINDS))}; known: {', '.join(KINDS)}")
    cpu_fused.load_fused()
    counts = dict.fromkeys((*KINDS, "rejected"), 0)
    dtype = model_dtype(model)
    if dtype is None or not cpu_fused.supported(dtype):
        return counts
    for name, module in _modules(model):
        if "rms_norm" in kinds and (norm := norm_candidate(module)) is not None:
            fused: torch.nn.Module | None = _fused_norm(module, *norm)
            _replace(model, name, module, fused, fused is not None, "rms_norm", counts)
        elif "gated_mlp" in kinds and mlp_candidate(module, dtype):
            fused = FusedGatedMLP.of(module)
            _replace(model, name, module, fused, _reproduces(module, fused, fused.gate_up_proj.in_features, dtype),
                     "gated_mlp", counts)
    probes = _fuse_attention(model, dtype, counts) if "attention" in kinds else {}
    if "decoder_layer" in kinds:
        _fuse_decoder_layers(model, probes, counts)
    if "decoder" in kinds:
        _fuse_decoder(model, probes, counts)
    return counts
