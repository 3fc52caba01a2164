"""SoftCappedHead: a model's output layer followed by its final logit soft-cap (Gemma 2's
``final_logit_softcapping``: ``tanh(logits / c) * c``), computed in place.

transformers' Gemma code caps the logits after ``lm_head`` in three passes that each allocate a
new ``[rows, vocab]`` tensor: with Gemma's 256,000-token vocabulary, 1 MiB a row three times a
step, and a sixth of a 32-row decode step of a 2B model (``docs/gguf.md``). In place, the same
three ops (a division by the same scalar, ``tanh``, a product by it) give the same bits without
the copies.

:func:`cap_in_place` puts the head in and clears the config's setting, so that the model's own
code does not cap a second time; the runner's ``compute_logits`` (scored prompt positions)
calls the output embeddings, this head, so those are capped once too, and by this code alone.
"""

from __future__ import annotations

from typing import Any

import torch


class SoftCappedHead(torch.nn.Module):
    """``head(x)``, then ``tanh(· / cap) * cap`` in place on its fresh output."""

    def __init__(self, head: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.head = head
        self.cap = float(cap)
        self.in_features = head.in_features
        self.out_features = head.out_features

    def extra_repr(self) -> str:
        return f"cap={self.cap}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).div_(self.cap).tanh_().mul_(self.cap)


def cap_in_place(model: Any, text_config: Any) -> bool:
    """Move ``model``'s final logit soft-cap (``text_config``'s, the language model's config)
    into its output layer (see the module docstring); False (nothing changed) for a model
    without one."""
    cap = getattr(text_config, "final_logit_softcapping", None)
    head = model.get_output_embeddings()
    if not cap or head is None or isinstance(head, SoftCappedHead) or not hasattr(head, "out_features"):
        return False
    model.set_output_embeddings(SoftCappedHead(head, cap))
    text_config.final_logit_softcapping = None
    return True
