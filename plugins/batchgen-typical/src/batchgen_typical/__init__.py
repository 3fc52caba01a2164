"""batchgen sampler plugin: locally typical sampling and eta sampling.

batchgen finds this module through the ``batchgen`` entry point declared in pyproject.toml and
calls :func:`batchgen_register_samplers`. Nothing here imports torch: the processors in
:mod:`batchgen_typical.processors` import it when the engine first calls them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from batchgen.plugins import SamplerSpec, hookimpl
from batchgen_typical.processors import EtaProcessor, TypicalProcessor

__version__ = "0.1.0"


class TypicalOptions(BaseModel):
    """Options of the ``typical`` sampler."""

    model_config = ConfigDict(extra="forbid")

    mass: float = Field(0.9, gt=0.0, le=1.0, description="Probability mass of the typical set to keep.")
    min_tokens_to_keep: int = Field(1, ge=1, description="Never keep fewer tokens than this per row.")


class EtaOptions(BaseModel):
    """Options of the ``eta`` sampler."""

    model_config = ConfigDict(extra="forbid")

    epsilon: float = Field(3e-4, gt=0.0, lt=1.0, description="Upper bound of the entropy-scaled cut-off eta.")


def _typical(options: BaseModel) -> TypicalProcessor:
    assert isinstance(options, TypicalOptions)
    return TypicalProcessor(mass=options.mass, min_tokens_to_keep=options.min_tokens_to_keep)


def _eta(options: BaseModel) -> EtaProcessor:
    assert isinstance(options, EtaOptions)
    return EtaProcessor(epsilon=options.epsilon)


@hookimpl
def batchgen_register_samplers() -> list[SamplerSpec]:
    """Register ``typical`` and ``eta``."""
    return [
        SamplerSpec(
            name="typical",
            description="Locally typical sampling: keep the tokens whose surprisal is closest to the entropy.",
            options_model=TypicalOptions,
            factory=_typical,
        ),
        SamplerSpec(
            name="eta",
            description="Eta sampling: drop tokens below min(epsilon, sqrt(epsilon) * exp(-entropy)).",
            options_model=EtaOptions,
            factory=_eta,
        ),
    ]
