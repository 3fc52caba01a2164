"""What a plugin hands to batchgen: :class:`SamplerSpec` and :class:`MetricSpec`.

Both are small frozen records. The registry checks their fields when a plugin returns them, so a
malformed spec is reported with the plugin's name rather than failing later in the step loop.
This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    import torch

    from batchgen.metrics import Metric


class LogitsProcessor(Protocol):
    """A per-step logits transform contributed by a sampler plugin.

    ``proc(logits, output_token_ids)`` receives float32 ``logits[rows, vocab]`` (after penalties
    and temperature, before top-k / top-p / min-p) and, for each row, the token ids generated so
    far. It returns a tensor of the same shape (it may modify ``logits`` in place and return it).
    It masks a token by setting its logit to ``-inf`` and must leave at least one finite logit per
    row that had one. It is called on every decoding step, so it must be cheap and must not call
    any hook.
    """

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplerSpec:
    """A named logits processor with an options schema.

    Attributes:
        name: Global name used in the config's ``generation.sampler.name``.
        description: One line shown by ``batchgen plugins``.
        options_model: A pydantic model class validating the sampler's options.
        factory: ``factory(options) -> LogitsProcessor``, called with a validated
            ``options_model`` instance.
    """

    name: str
    description: str
    options_model: type[BaseModel]
    factory: Callable[[BaseModel], LogitsProcessor]


@dataclass(frozen=True)
class MetricSpec:
    """A named metric with an options schema.

    Attributes:
        name: Global name used in the config's ``metrics`` list.
        description: One line shown by ``batchgen plugins``.
        options_model: A pydantic model class validating the metric's options.
        factory: ``factory(options) -> Metric`` (see :class:`batchgen.metrics.Metric`), called with
            a validated ``options_model`` instance.
    """

    name: str
    description: str
    options_model: type[BaseModel]
    factory: Callable[[BaseModel], Metric]
