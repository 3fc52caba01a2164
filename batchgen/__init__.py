"""batchgen: offline batch generation for LLMs over a paged KV cache.

Public API (vLLM's names)::

    from batchgen import LLM, SamplingParams, BeamSearchParams, TokensPrompt
    outputs = LLM().generate(["Hello", TokensPrompt(prompt_token_ids=[1, 2])],
                             sampling_params=SamplingParams(max_tokens=32))
    replies = LLM(config=EngineConfig(dtype="bfloat16")).chat(
        [{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))

Names are imported lazily, so that ``import batchgen.config`` (and the other core modules)
does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "LLM", "EngineConfig", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "Request", "RequestOutput", "CompletionOutput",
    "Logprob", "RequestStats", "EngineStats", "TextPrompt", "TokensPrompt", "PromptType", "BeamSearchOutput",
    "BeamSearchSequence", "LoRARequest", "hookimpl", "__version__",
]

_LAZY = {
    "LLM": ("batchgen.engine.llm", "LLM"),
    "EngineConfig": ("batchgen.engine.config", "EngineConfig"),
    "SamplingParams": ("batchgen.sampling.params", "SamplingParams"),
    "BeamSearchParams": ("batchgen.sampling.params", "BeamSearchParams"),
    "StructuredOutputsParams": ("batchgen.sampling.params", "StructuredOutputsParams"),
    "Request": ("batchgen.engine.outputs", "Request"),
    "RequestOutput": ("batchgen.engine.outputs", "RequestOutput"),
    "CompletionOutput": ("batchgen.engine.outputs", "CompletionOutput"),
    "Logprob": ("batchgen.engine.outputs", "Logprob"),
    "EngineStats": ("batchgen.engine.outputs", "EngineStats"),
    "BeamSearchOutput": ("batchgen.engine.outputs", "BeamSearchOutput"),
    "BeamSearchSequence": ("batchgen.engine.outputs", "BeamSearchSequence"),
    "TextPrompt": ("batchgen.engine.prompts", "TextPrompt"),
    "TokensPrompt": ("batchgen.engine.prompts", "TokensPrompt"),
    "PromptType": ("batchgen.engine.prompts", "PromptType"),
    "RequestStats": ("batchgen.engine.sequence", "RequestStats"),
    "hookimpl": ("batchgen.plugins", "hookimpl"),
    "LoRARequest": ("batchgen.lora.request", "LoRARequest"),
}

if TYPE_CHECKING:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.llm import LLM
    from batchgen.engine.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, EngineStats,
                                         Logprob, Request, RequestOutput)
    from batchgen.engine.prompts import PromptType, TextPrompt, TokensPrompt
    from batchgen.engine.sequence import RequestStats
    from batchgen.lora.request import LoRARequest
    from batchgen.plugins import hookimpl
    from batchgen.sampling.params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # lazy names: `LLM` imports torch, the others stay torch-free
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
