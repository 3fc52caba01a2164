"""FusedDecoderLayer: an HF pre-norm decoder layer whose four parts are all fused, run by one
lean forward: ``x + mlp(norm2(x + attn(norm1(x))))`` with the middle residual add and the second
norm in one C pass; and :class:`LeanDecoderForward`, the forward of a decoder whose layers all
are such layers, for the engine's calls.

Why: once its norms, attention and MLP are fused (:mod:`batchgen.engine.fusion`), what is left
of an HF decoder layer in a decode step is its own forward: the gradient-checkpointing and
deprecated-argument wrappers around it, the keyword arguments it hands on, and two residual adds
in torch, each a dispatch and a fresh tensor. On the 1B Llama-shaped Q4_K file at batch 1, with
every C kernel made a no-op to leave only that work, a layer took 65 us through HF's forward and
60 us through this one (figures in ``docs/kernels.md``).

Which layers: :func:`batchgen.engine.fusion.fuse_model` replaces a layer whose children are
exactly ``input_layernorm`` and ``post_attention_layernorm`` (each a
:class:`~batchgen.engine.fused_layers.FusedRMSNorm`), ``self_attn`` (a
:class:`~batchgen.engine.fused_attention.FusedAttention`) and ``mlp`` (a
:class:`~batchgen.engine.fused_layers.FusedGatedMLP`), and only where, on the attention probe,
this forward gives the layer's own output and K/V bit for bit. A layer of other semantics (extra
norms around the attention or the MLP, scaled residuals, a parallel attention and MLP) fails one
check or the other and stays as it is.

The decoder (``model.model``: embeddings, rotary embedding, layers, final norm) keeps HF's
forward for any call but the engine's; on the engine's (``input_ids``, ``position_ids``,
``batchgen_metadata`` and nothing else) :class:`LeanDecoderForward` runs the embedding, the
rotary embedding, the layers and the norm, without HF's mask building (the paged attention
ignores masks), output-capturing and config-default wrappers, or the per-step slice of the
layer list: about 100 us a step, whatever the batch. The module is the same, so its hooks
(the runner's prompt-logprob capture) still run. It is installed only where, on the attention
probe's step over every layer, the model's logits and K/V are HF's bit for bit.

Numerics: the same modules run on the same inputs; ``s = x + h`` is torch's add bit for bit and
the norm of ``s`` is :func:`~batchgen.kernels.cpu.fused.rms_norm`'s
(:func:`~batchgen.kernels.cpu.fused.add_rms_norm`), and the last add is torch's: the layer's
bits do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from batchgen.engine.fused_attention import FusedAttention
from batchgen.engine.fused_layers import FusedGatedMLP, FusedRMSNorm
from batchgen.kernels.cpu import fused as cpu_fused

#: The children a decoder (``model.model``) must have, exactly, for :class:`LeanDecoderForward`.
DECODER_PARTS = {"embed_tokens", "layers", "norm", "rotary_emb"}

#: The children a decoder layer must have, exactly, and the fused kind each must be.
PARTS = {"input_layernorm": FusedRMSNorm, "self_attn": FusedAttention,
         "post_attention_layernorm": FusedRMSNorm, "mlp": FusedGatedMLP}


def candidate(module: torch.nn.Module) -> bool:
    """Whether ``module``'s children are :data:`PARTS`, each of its fused kind, and besides them
    only dropouts (Phi-3's ``resid_attn_dropout`` and ``resid_mlp_dropout`` around its residual
    adds: the identity at inference); whether it composes them as a pre-norm layer is left to
    the probe, which also rejects a dropout that acts."""
    children = dict(module.named_children())
    others = [child for name, child in children.items() if name not in PARTS]
    return (not isinstance(module, FusedDecoderLayer) and PARTS.keys() <= children.keys()
            and all(type(child) is torch.nn.Dropout for child in others)
            and all(isinstance(children[name], kind) for name, kind in PARTS.items()))


class FusedDecoderLayer(torch.nn.Module):
    """``h = x + self_attn(input_layernorm(x))``, then ``h + mlp(post_attention_layernorm(h))``,
    over the layer's own (fused) parts, which it takes over; the layer's plain attributes
    (``attention_type``, ``layer_idx`` ...: what a model's forward may read off its layers) are
    copied."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and name != "training" and not isinstance(value, torch.nn.Module):
                setattr(self, name, value)
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                batchgen_metadata: Any = None, **kwargs: Any) -> torch.Tensor:
        """HF's decoder-layer call; ``position_ids``, ``cache``, ``use_cache`` ... arrive in
        ``kwargs`` and are not needed (the fused attention reads ``position_embeddings`` and the
        paged cache of ``batchgen_metadata``)."""
        attended, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                                     batchgen_metadata=batchgen_metadata)
        norm = self.post_attention_layernorm
        residual, normed = cpu_fused.add_rms_norm(hidden_states, attended, norm.weight, norm.variance_epsilon)
        return residual.add_(self.mlp(normed))


def lean_candidate(decoder: Any) -> bool:
    """Whether ``decoder``'s children are exactly :data:`DECODER_PARTS`, its layers (all of the
    config's ``num_hidden_layers``) each a :class:`FusedDecoderLayer`."""
    if not isinstance(decoder, torch.nn.Module) or dict(decoder.named_children()).keys() != DECODER_PARTS:
        return False
    layers = decoder.layers
    count = getattr(getattr(decoder, "config", None), "num_hidden_layers", None)
    return (isinstance(layers, torch.nn.ModuleList) and len(layers) == count
            and all(isinstance(layer, FusedDecoderLayer) for layer in layers))


class LeanDecoderForward:
    """A decoder's forward (installed as the instance's ``forward``): the engine's calls run the
    embedding, rotary embedding, layers and norm directly; any other call (a mask, a cache,
    ``inputs_embeds``, other keywords) goes to the decoder's own forward, kept here."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.decoder = decoder
        self.original = decoder.forward
        #: a :class:`~batchgen.engine.decoder_program.DecoderProgram` that runs the layers of the
        #: decode steps it takes in one C call (set by its ``install``), or None
        self.program = None

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                 position_ids: torch.Tensor | None = None, cache: Any = None, inputs_embeds: Any = None,
                 use_cache: bool | None = None, batchgen_metadata: Any = None, **kwargs: Any) -> Any:
        if (input_ids is None or position_ids is None or batchgen_metadata is None or attention_mask is not None
                or cache is not None or inputs_embeds is not None or use_cache or kwargs):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 batchgen_metadata=batchgen_metadata, **kwargs)
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
        program = self.program
        if program is not None and program.runs(hidden, *position_embeddings, batchgen_metadata):
            program.run(hidden, *position_embeddings, batchgen_metadata)
        else:
            for layer in decoder.layers:
                hidden = layer(hidden, position_embeddings=position_embeddings, batchgen_metadata=batchgen_metadata)
        return BaseModelOutputWithPast(last_hidden_state=decoder.norm(hidden))
