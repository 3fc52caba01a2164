"""FusedDecoderLayer: an HF decoder layer whose parts are all fused, run by one lean forward:
``x + mlp(norm2(x + attn(norm1(x))))`` (or Gemma's sandwich, with a norm on the attention's and
the MLP's outputs too) with the middle residual add and the next norm in one C pass; and
:class:`LeanDecoderForward`, the forward of a decoder whose layers all are such layers, for
the engine's calls.

Why: once its norms, attention and MLP are fused (:mod:`batchgen.engine.fusion`), what is left
of an HF decoder layer in a decode step is its own forward: the gradient-checkpointing and
deprecated-argument wrappers around it, the keyword arguments it hands on, and two residual adds
in torch, each a dispatch and a fresh tensor. On the 1B Llama-shaped Q4_K file at batch 1, with
every C kernel made a no-op to leave only that work, a layer took 65 us through HF's forward and
60 us through this one (figures in ``docs/kernels.md``).

Which layers: :func:`batchgen.engine.fusion.fuse_model` replaces a layer whose children are
those of a :data:`LAYER_FORMS` row (Llama's ``input_layernorm`` and
``post_attention_layernorm``, each a :class:`~batchgen.engine.fused_layers.FusedRMSNorm`,
``self_attn``, a :class:`~batchgen.engine.fused_attention.FusedAttention`, and ``mlp``, a
:class:`~batchgen.engine.fused_layers.FusedGatedMLP`; or Gemma's six), and only where, on the
attention probe, this forward gives the layer's own output and K/V bit for bit. A layer of
other semantics (scaled residuals, a parallel attention and MLP) fails one check or the other
and stays as it is.

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

import inspect
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from batchgen.engine.fused_attention import FusedAttention
from batchgen.engine.fused_layers import FusedGatedMLP, FusedRMSNorm
from batchgen.kernels.cpu import fused as cpu_fused

#: The children a decoder (``model.model``) must have, exactly, for :class:`LeanDecoderForward`.
DECODER_PARTS = {"embed_tokens", "layers", "norm", "rotary_emb"}

#: The decoder-layer forms :class:`FusedDecoderLayer` runs: each child's HF name and the role it
#: plays. ``pre_norm`` is Llama's ``h = x + attn(norm1(x))``, ``h + mlp(norm2(h))``;
#: ``sandwich`` is Gemma 2/3's, whose two more norms take the attention's and the MLP's
#: outputs before their residual adds (and whose ``post_attention_layernorm`` is one of those).
LAYER_FORMS: dict[str, dict[str, str]] = {
    "pre_norm": {"input_layernorm": "attn_norm", "self_attn": "attn", "post_attention_layernorm": "mlp_norm",
                 "mlp": "mlp"},
    "sandwich": {"input_layernorm": "attn_norm", "self_attn": "attn", "post_attention_layernorm": "attn_out_norm",
                 "pre_feedforward_layernorm": "mlp_norm", "mlp": "mlp", "post_feedforward_layernorm": "mlp_out_norm"},
}
#: The fused kind each role must be.
ROLE_KINDS = {"attn_norm": FusedRMSNorm, "attn": FusedAttention, "attn_out_norm": FusedRMSNorm,
              "mlp_norm": FusedRMSNorm, "mlp": FusedGatedMLP, "mlp_out_norm": FusedRMSNorm}


def layer_form(module: torch.nn.Module) -> str | None:
    """The :data:`LAYER_FORMS` row whose children ``module`` has, each of its role's fused kind,
    with only dropouts besides (Phi-3's ``resid_attn_dropout`` and ``resid_mlp_dropout`` around
    its residual adds: the identity at inference); None if none fits. Whether it composes them
    as the form says is left to the probe, which also rejects a dropout that acts."""
    if isinstance(module, FusedDecoderLayer):
        return None
    children = dict(module.named_children())
    for form, roles in LAYER_FORMS.items():
        others = [child for name, child in children.items() if name not in roles]
        if (roles.keys() <= children.keys() and all(type(child) is torch.nn.Dropout for child in others)
                and all(isinstance(children[name], ROLE_KINDS[role]) for name, role in roles.items())):
            return form
    return None


def candidate(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a decoder layer of one of :data:`LAYER_FORMS` (:func:`layer_form`)."""
    return layer_form(module) is not None


class FusedDecoderLayer(torch.nn.Module):
    """A decoder layer of one of :data:`LAYER_FORMS`, over the layer's own (fused) parts, which it
    takes over under their HF names: ``a = attn(attn_norm(x))`` (then ``attn_out_norm(a)`` in
    the sandwich form), ``s = x + a``, ``y = mlp(mlp_norm(s))`` (then ``mlp_out_norm(y)``),
    ``s + y``. The layer's plain attributes (``attention_type``, ``layer_idx`` ...: what a
    model's forward may read off its layers) are copied."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        form = layer_form(layer)
        if form is None:
            raise ValueError(f"{type(layer).__name__} is not a decoder layer of a form in LAYER_FORMS")
        for name, value in vars(layer).items():
            if not name.startswith("_") and name != "training" and not isinstance(value, torch.nn.Module):
                setattr(self, name, value)
        self.form = form
        roles = LAYER_FORMS[form]
        for name in roles:
            setattr(self, name, getattr(layer, name))
        #: each role's child name, for the forward and the decoder program (:meth:`role`)
        self.role_names = {role: name for name, role in roles.items()}

    def role(self, role: str) -> torch.nn.Module | None:
        """The child playing ``role`` (a key of :data:`ROLE_KINDS`), or None where the form has
        no such role (looked up each call: a child replaced later, as by LoRA, is the one run)."""
        name = self.role_names.get(role)
        return None if name is None else getattr(self, name)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                batchgen_metadata: Any = None, **kwargs: Any) -> torch.Tensor:
        """HF's decoder-layer call; ``position_ids``, ``cache``, ``use_cache`` ... arrive in
        ``kwargs`` and are not needed (the fused attention reads ``position_embeddings`` and the
        paged cache of ``batchgen_metadata``)."""
        role = self.role
        attended, _ = role("attn")(role("attn_norm")(hidden_states), position_embeddings=position_embeddings,
                                   batchgen_metadata=batchgen_metadata)
        if (attn_out_norm := role("attn_out_norm")) is not None:
            attended = attn_out_norm(attended)
        norm = role("mlp_norm")
        residual, normed = cpu_fused.add_rms_norm(hidden_states, attended, norm.weight, norm.variance_epsilon)
        out = role("mlp")(normed)
        if (mlp_out_norm := role("mlp_out_norm")) is not None:
            out = mlp_out_norm(out)
        return residual.add_(out)


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
        #: the rotary tables a step computes: the layer types whose own cos/sin the rotary
        #: embedding gives (its ``forward`` takes a ``layer_type``: Gemma 3's local and global
        #: RoPE), in first-use order, or ``[None]`` for its one table; and each layer's index
        #: into them (HF's forward hands layer ``i`` the table of ``config.layer_types[i]``)
        self.rope_keys: list[str | None] = [None]
        self.layer_rope = [0] * len(decoder.layers)
        types = getattr(getattr(decoder, "config", None), "layer_types", None)
        if types and "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters:
            self.rope_keys = list(dict.fromkeys(types))
            self.layer_rope = [self.rope_keys.index(t) for t in types[:len(decoder.layers)]]

    def rotary_tables(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's cos/sin tables, one per :attr:`rope_keys` entry."""
        rotary = self.decoder.rotary_emb
        if self.rope_keys == [None]:
            return [rotary(hidden, position_ids=position_ids)]
        return [rotary(hidden, position_ids, key) for key in self.rope_keys]

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
        tables = self.rotary_tables(hidden, position_ids)
        program = self.program
        if program is not None and program.runs(hidden, tables, batchgen_metadata):
            program.run(hidden, tables, batchgen_metadata)
        else:
            for layer, rope in zip(decoder.layers, self.layer_rope):
                hidden = layer(hidden, position_embeddings=tables[rope], batchgen_metadata=batchgen_metadata)
        return BaseModelOutputWithPast(last_hidden_state=decoder.norm(hidden))
