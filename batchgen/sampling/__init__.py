"""Sampling: validated parameters, the batched sampler and beam-search bookkeeping.

Importing this package does not import torch: ``SamplingParams`` and ``BeamSearchParams`` are
loaded eagerly (torch-free), while the torch-based ``Sampler`` and its row/output types, and the
pure-Python beam-search state, are resolved lazily on first attribute access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchgen.sampling.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from batchgen.sampling.beam_ranking import BeamHypothesis, BeamSearchState
    from batchgen.sampling.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = [
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "Sampler",
    "SamplingRow",
    "SamplerOutput",
    "BeamSearchState",
    "BeamHypothesis",
]

# name -> submodule that defines it; imported on first access so that torch stays optional
# for the torch-free core modules that only need the parameter classes.
_LAZY = {
    "Sampler": "batchgen.sampling.sampler",
    "SamplingRow": "batchgen.sampling.sampler",
    "SamplerOutput": "batchgen.sampling.sampler",
    "BeamSearchState": "batchgen.sampling.beam_ranking",
    "BeamHypothesis": "batchgen.sampling.beam_ranking",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchgen.sampling' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value
