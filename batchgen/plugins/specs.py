"""What a plugin hands to batchgen: :class:`SamplerSpec` and :class:`MetricSpec`, and the two
processor contracts a sampler's factory may return: the stateless :class:`LogitsProcessor` and
the stateful :class:`StatefulLogitsProcessor` (with its per-sequence :class:`ProcessorState`).

Both are small frozen records. The registry checks their fields when a plugin returns them, so a
malformed spec is reported with the plugin's name rather than failing later in the step loop.
This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

# The processor contracts live in batchgen.sampling.processors; re-exported for plugins.
from batchgen.sampling.processors import LogitsProcessor, ProcessorState, StatefulLogitsProcessor, allow_only  # noqa: F401

if TYPE_CHECKING:
    from batchgen.metrics import Metric


@dataclass(frozen=True)
class SamplerSpec:
    """A named logits processor with an options schema.

    Attributes:
        name: Global name used in the config's ``generation.sampler.name``.
        description: One line shown by ``batchgen plugins``.
        options_model: A pydantic model class validating the sampler's options.
        factory: ``factory(options) -> LogitsProcessor`` (or a
            :class:`StatefulLogitsProcessor`), called with a validated ``options_model`` instance.
    """

    name: str
    description: str
    options_model: type[BaseModel]
    factory: Callable[[BaseModel], LogitsProcessor | StatefulLogitsProcessor]


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
