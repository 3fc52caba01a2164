"""The logits processors: ``proc(logits[rows, vocab], output_token_ids) -> logits``.

Both work row-wise on float32 logits that batchgen has already penalised and divided by the
temperature, and mask by writing ``-inf`` in place. Tokens that are already ``-inf`` have
probability 0 and stay masked. torch is imported inside ``__call__`` so that importing the plugin
(to list or validate it) does not load torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Row entropies ``H = -sum p log p`` as a ``[rows, 1]`` column; masked tokens add 0."""
    import torch

    probs = log_probs.exp()
    # p * log p is 0 * -inf = nan for masked tokens; their contribution is 0 by continuity.
    terms = torch.where(probs > 0, probs * log_probs, torch.zeros_like(log_probs))
    return -terms.sum(dim=-1, keepdim=True)


class TypicalProcessor:
    """Locally typical sampling.

    Per row, tokens are ranked by ``|-log p - H|`` (how far their surprisal is from the
    entropy), and the shortest prefix of that ranking whose probability mass reaches ``mass`` is
    kept: a token is kept when the mass of the tokens ranked before it is still below ``mass``.
    At least ``min_tokens_to_keep`` tokens are kept.
    """

    def __init__(self, mass: float = 0.9, min_tokens_to_keep: int = 1) -> None:
        if not 0.0 < mass <= 1.0:
            raise ValueError(f"mass must be in (0, 1], got {mass}")
        self.mass = mass
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
        import torch

        log_probs = torch.log_softmax(logits, dim=-1)
        deviation = (-log_probs - entropy(log_probs)).abs()  # +inf for masked tokens: ranked last
        order = torch.argsort(deviation, dim=-1, stable=True)
        sorted_probs = log_probs.exp().gather(-1, order)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < self.mass
        keep_sorted[..., : self.min_tokens_to_keep] = True
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        return logits.masked_fill_(~keep, float("-inf"))

    def __repr__(self) -> str:
        return f"TypicalProcessor(mass={self.mass}, min_tokens_to_keep={self.min_tokens_to_keep})"


class EtaProcessor:
    """Eta sampling: drop tokens with ``p < min(epsilon, sqrt(epsilon) * exp(-H))``.

    The row's most likely token is always kept.
    """

    def __init__(self, epsilon: float = 3e-4) -> None:
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
        import torch

        log_probs = torch.log_softmax(logits, dim=-1)
        eta = torch.clamp(math.sqrt(self.epsilon) * torch.exp(-entropy(log_probs)), max=self.epsilon)
        remove = log_probs.exp() < eta
        remove.scatter_(-1, log_probs.argmax(dim=-1, keepdim=True), False)
        return logits.masked_fill_(remove, float("-inf"))

    def __repr__(self) -> str:
        return f"EtaProcessor(epsilon={self.epsilon})"
