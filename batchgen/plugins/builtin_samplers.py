"""batchgen's built-in samplers, registered through the public hooks like any plugin's.

* ``epsilon``: epsilon sampling (Hewitt et al., 2022): drop every token whose probability is
  below a fixed ``epsilon``.
* ``top_a``: top-a sampling: drop every token whose probability is below ``a * p_max**2``, so the
  cut adapts to how confident the model is.

Both keep the most likely token of each row, so a row never ends up fully masked. torch is
imported inside the processors only, when the engine first calls them: importing this module
(as ``batchgen plugins`` and ``batchgen validate`` do) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from batchgen.plugins.hookspecs import hookimpl
from batchgen.plugins.specs import SamplerSpec

if TYPE_CHECKING:
    import torch


def mask_below(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every logit whose softmax probability is below ``threshold``.

    ``threshold`` broadcasts against ``[rows, vocab]`` (a scalar or a ``[rows, 1]`` column). Each
    row's most likely token is always kept. Rows without any finite logit are left unchanged.
    """
    # deferred: torch (~5 s) only when a sampler runs; the plugins package stays torch-free
    import torch

    probs = torch.softmax(logits, dim=-1)
    remove = probs < threshold  # NaN rows (all -inf) compare False: nothing removed
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill_(remove, float("-inf"))


class EpsilonOptions(BaseModel):
    """Options of the ``epsilon`` sampler."""

    model_config = ConfigDict(extra="forbid")

    epsilon: float = Field(3e-4, gt=0.0, lt=1.0, description="Drop tokens with probability below this.")


class EpsilonProcessor:
    """Masks the tokens whose probability is below a fixed epsilon."""

    def __init__(self, epsilon: float) -> None:
        self.epsilon = epsilon

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
        return mask_below(logits, self.epsilon)  # type: ignore[arg-type]


class TopAOptions(BaseModel):
    """Options of the ``top_a`` sampler."""

    model_config = ConfigDict(extra="forbid")

    a: float = Field(0.2, gt=0.0, le=1.0, description="Drop tokens with probability below a * p_max**2.")


class TopAProcessor:
    """Masks the tokens whose probability is below ``a * p_max**2`` in their row."""

    def __init__(self, a: float) -> None:
        self.a = a

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
        # deferred: torch (~5 s) only when a sampler runs; the plugins package stays torch-free
        import torch

        p_max = torch.softmax(logits, dim=-1).amax(dim=-1, keepdim=True)
        return mask_below(logits, self.a * p_max * p_max)


def _epsilon(options: BaseModel) -> EpsilonProcessor:
    assert isinstance(options, EpsilonOptions)
    return EpsilonProcessor(options.epsilon)


def _top_a(options: BaseModel) -> TopAProcessor:
    assert isinstance(options, TopAOptions)
    return TopAProcessor(options.a)


@hookimpl
def batchgen_register_samplers() -> list[SamplerSpec]:
    """The built-in samplers: ``epsilon`` and ``top_a``."""
    return [
        SamplerSpec(
            name="epsilon",
            description="Epsilon sampling: drop tokens whose probability is below epsilon.",
            options_model=EpsilonOptions,
            factory=_epsilon,
        ),
        SamplerSpec(
            name="top_a",
            description="Top-a sampling: drop tokens whose probability is below a * p_max^2.",
            options_model=TopAOptions,
            factory=_top_a,
        ),
    ]
