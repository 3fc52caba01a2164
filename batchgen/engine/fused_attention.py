"""FusedAttention: an HF attention layer on the CPU path as one q/k/v GEMM, RoPE and the KV-cache
write in one C pass, then the paged attention.

Why: in a decode step of a small model, HF's attention layer is a chain of narrow ops per layer
(three q/k/v GEMMs, views and transposes, about ten element-wise ops for rotate-half RoPE, the
attention-interface dispatch, two ``index_copy_`` into the cache, a reshape and copy before
``o_proj``); over a few dozen rows their dispatch costs more than their arithmetic, and one
GEMM over the concatenated q/k/v weights runs faster than three narrow ones. Figures are in
``docs/kernels.md``.

:func:`fuse_attention` replaces, in a model on the CPU whose linear layers go through batchgen's
C GEMM (``linear_backend="cpu"``), each attention layer that looks like HF's Llama attention
(``q_proj``/``k_proj``/``v_proj``/``o_proj`` plain ``nn.Linear``, ``head_dim``, ``layer_idx``,
``scaling``; the model's config without partial rotary) by a :class:`FusedAttention`, **only if**
the fused layer reproduces the original on a probe: hidden states with the model's own rotary
``cos``/``sin``, a mixed decode + prefill step over a small probe cache, the original run through
batchgen's attention interface. Outputs and the K/V written must agree (to float rounding: the
packed GEMM sums in its own order). A layer with other semantics (Qwen3's per-head q/k norms,
partial or interleaved rotary, another attention variant) fails the probe and stays as it is.

Numerics: the q/k/v GEMM gives each output column exactly what the separate packed q, k and v
layers give (one chain of multiply-adds per column, :mod:`batchgen.kernels.cpu.linear`), RoPE
equals torch's bit for bit (:func:`batchgen.kernels.cpu.fused.rope_and_cache`), and the
attention is the runner's own backend (:func:`batchgen.engine.paged_attention.attend`): a fused model
computes what the unfused one does on the CPU path, bit for bit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from batchgen.engine import paged_attention
from batchgen.kernels.cpu import fused as cpu_fused
from batchgen.kernels.cpu.linear import PackedLinear

logger = logging.getLogger(__name__)

# The probe step: block size 4; one decode (context 6: five cached tokens, then the new one)
# and one prefill chunk of 4 tokens after 2 cached ones (context 6).
PROBE_BLOCK_SIZE = 4
PROBE_NUM_BLOCKS = 4
PROBE_POSITIONS = (5, 2, 3, 4, 5)
PROBE_SLOTS = (5, 10, 11, 12, 13)
# How far the fused layer's output and K/V may be from the original's on the probe, relative to
# the largest magnitude: the packed GEMM's rounding, amplified by the softmax (measured on
# SmolLM2: 2.6e-5 in float32, 2.2e-3 in bfloat16, 5.2e-4 in float16). Another semantics (a
# per-head norm, another rotary) is off by the order of the values themselves.
PROBE_TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class FusedAttention(torch.nn.Module):
    """An HF rotate-half attention layer: one packed GEMM for q, k and v, RoPE and the K/V
    cache write in one C pass (:func:`~batchgen.kernels.cpu.fused.rope_and_cache`), the
    paged attention of the runner's backend (:func:`~batchgen.engine.paged_attention.attend`), then
    ``o_proj``.

    Built from the layer it replaces (which it no longer needs): its q/k/v weights (and
    biases) are concatenated and packed; ``o_proj`` is packed as is.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        q, k, v = module.q_proj, module.k_proj, module.v_proj
        self.head_dim = int(module.head_dim)
        self.num_heads = q.out_features // self.head_dim
        self.num_kv_heads = k.out_features // self.head_dim
        self.layer_idx = module.layer_idx
        self.scaling = float(module.scaling)
        both = torch.nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                               bias=q.bias is not None, device="meta")
        both.weight = torch.nn.Parameter(torch.cat([q.weight.detach(), k.weight.detach(), v.weight.detach()]),
                                         requires_grad=False)
        if q.bias is not None:
            both.bias = torch.nn.Parameter(torch.cat([q.bias.detach(), k.bias.detach(), v.bias.detach()]),
                                           requires_grad=False)
        self.qkv_proj = PackedLinear(both)
        self.o_proj = PackedLinear(module.o_proj)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        batchgen_metadata: paged_attention.AttentionMetadata | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """HF's attention call (``position_ids``, ``cache``, ``use_cache``, ``sliding_window``
        ... arrive in ``kwargs`` and are not needed: positions come as ``cos``/``sin``, the
        cache is the paged one, and the runner caps the context at any window).

        Args:
            hidden_states: ``[1, num_tokens, hidden]``, the packed row.
            position_embeddings: ``(cos, sin)``, each ``[1, num_tokens, head_dim]``.
            batchgen_metadata: the step's :class:`~batchgen.engine.paged_attention.AttentionMetadata`.

        Returns:
            ``([1, num_tokens, hidden], None)``.
        """
        meta = batchgen_metadata
        if meta is None or position_embeddings is None:
            raise RuntimeError("FusedAttention runs only inside the batchgen engine "
                               "(batchgen_metadata and position_embeddings are needed)")
        cos, sin = position_embeddings
        qkv = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[-2]
        layer = self.layer_idx
        cpu_fused.rope_and_cache(qkv, cos, sin, meta.kv_cache[layer, 0], meta.kv_cache[layer, 1],
                                 meta.slot_mapping, self.num_heads)
        width = self.num_heads * self.head_dim
        query = qkv.view(num_tokens, -1)[:, :width].view(num_tokens, self.num_heads, self.head_dim)
        out = paged_attention.attend(query, layer, self.scaling, meta)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], width)), None


def _candidate(module: torch.nn.Module) -> bool:
    """Whether ``module`` has the attributes of an HF rotate-half attention layer whose linears
    are CPU ``nn.Linear`` of one dtype the C ops run, with shapes that fit (whether it *is*
    one is left to the probe)."""
    parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(type(p) is torch.nn.Linear for p in parts):
        return False
    head_dim, layer, scaling = (getattr(module, name, None) for name in ("head_dim", "layer_idx", "scaling"))
    if not isinstance(head_dim, int) or not isinstance(layer, int) or not isinstance(scaling, (int, float)):
        return False
    q, k, v, o = parts
    dtype = q.weight.dtype
    if (not cpu_fused.supported(dtype) or head_dim <= 0 or head_dim % 2
            or any(p.weight.dtype != dtype or p.weight.device.type != "cpu" for p in parts)):
        return False
    return (q.in_features == k.in_features == v.in_features and k.out_features == v.out_features
            and q.out_features % head_dim == 0 and k.out_features % head_dim == 0
            and (q.out_features // head_dim) % (k.out_features // head_dim) == 0
            and o.in_features == q.out_features
            and (q.bias is None) == (k.bias is None) == (v.bias is None))


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


class _Probe:
    """The probe step: hidden states, the model's cos/sin at the probe positions, a probe cache
    (filled with the same random values before each run) and its metadata."""

    def __init__(self, rotary: torch.nn.Module, hidden: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        from batchgen.kernels import torch_attention

        gen = torch.Generator().manual_seed(0)
        tokens = len(PROBE_POSITIONS)
        self.hidden_states = (torch.randn(1, tokens, hidden, generator=gen) * 2.0).to(dtype)
        positions = torch.tensor([PROBE_POSITIONS])
        with torch.no_grad():
            self.cos, self.sin = rotary(self.hidden_states, positions)
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
        """``module``'s output and the K/V it left in layer ``layer``'s probe cache."""
        self.meta.kv_cache.copy_(self.initial)
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


def _reproduces(original: torch.nn.Module, fused: FusedAttention, probe: _Probe, dtype: torch.dtype) -> bool:
    """Whether ``fused`` gives ``original``'s output and K/V on the probe (rounding aside)."""
    try:
        want, want_cache = probe.run(original, fused.layer_idx)
        got, got_cache = probe.run(fused, fused.layer_idx)
    except Exception as exc:  # noqa: BLE001 - a layer that cannot take the probe is not replaced
        # e.g. cos/sin narrower than the head (partial rotary), or a layer of another kind
        logger.debug("the attention probe failed: %s", exc)
        return False
    if not isinstance(want, tuple) or not isinstance(want[0], torch.Tensor):
        return False
    return _close(got[0], want[0], dtype) and _close(got_cache, want_cache, dtype)


def fuse_attention(model: torch.nn.Module) -> dict[str, int]:
    """Replace the attention layers of a float32, bfloat16 or float16 CPU ``model`` (loaded with
    batchgen's attention, ``attn_implementation="batchgen_paged"``) by :class:`FusedAttention`
    where the probe shows them equal (see the module docstring). Call before
    :func:`~batchgen.kernels.cpu.linear.pack_linears`, which packs the linears left.

    Returns:
        ``{"attention": fused layers, "rejected": candidates that failed the probe}``.

    Raises:
        batchgen.kernels.cpu.CpuKernelError: the fused ops' library cannot be built here.
    """
    cpu_fused.load_fused()
    counts = {"attention": 0, "rejected": 0}
    candidates = [(name, m) for name, m in model.named_modules() if _candidate(m)]
    if not candidates:
        return counts
    rotary = _rotary_embedding(model)
    if rotary is None or not _full_rotary(model.config):
        counts["rejected"] = len(candidates)
        logger.info("%d attention layers left unfused: the model's rotary embedding is not one "
                    "full-head rotate-half", len(candidates))
        return counts
    probes: dict[tuple[int, int, int, torch.dtype], _Probe] = {}
    num_layers = 1 + max(m.layer_idx for _, m in candidates)
    for name, module in candidates:
        fused = FusedAttention(module)
        dtype = module.q_proj.weight.dtype
        key = (module.q_proj.in_features, fused.num_kv_heads, fused.head_dim, dtype)
        if key not in probes:
            probes[key] = _Probe(rotary, key[0], num_layers, fused.num_kv_heads, fused.head_dim, dtype)
        if not _reproduces(module, fused, probes[key], dtype):
            counts["rejected"] += 1
            logger.info("%s (%s) left unfused: the fused attention does not reproduce it",
                        name, type(module).__name__)
            continue
        model.set_submodule(name, fused)
        counts["attention"] += 1
    return counts
