"""Model loading: a model name becomes a ready model on its device, before the runner sees it.

:func:`load_model` resolves the name (:func:`batchgen.model_resolver.resolve_model`: a folder,
a hub id, a GGUF file or the embedded model), reads its HF config, refuses what the paged
cache cannot run exactly (:func:`check_supported`), settles the dtype (:func:`resolve_dtype`)
and loads the weights with batchgen's paged attention registered: a GGUF's through
:func:`batchgen.gguf.loader.load_gguf_model`, any other through transformers, on the device,
in eval mode. :class:`~batchgen.engine.model_runner.ModelRunner` takes the
:class:`LoadedModel`; it sizes the KV cache, picks the attention backend and fuses the CPU
layers (``linear_backend``) itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine import paged_attention
from batchgen.engine.config import DTYPE_NAMES, EngineConfig, dtype_error
from batchgen.model_resolver import ResolvedModel, resolve_model

__all__ = ["LoadedModel", "UnsupportedModelError", "check_supported", "load_model", "resolve_dtype"]

logger = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}


class UnsupportedModelError(ValueError):
    """The model cannot run correctly on the paged cache; refused rather than run wrong."""


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """``"auto"`` = the checkpoint's dtype on GPU, float32 on CPU; else a named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        return cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(dtype_error(dtype))
    if dtype == "bfloat16" and device.type == "cpu":
        from batchgen.kernels.cpu.loader import missing_cpu_features

        if missing_cpu_features("avx512f") and missing_cpu_features("avx512_bf16"):
            logger.warning("dtype bfloat16 on a CPU without AVX-512 or AVX512-BF16: the linear layers "
                           "widen every bfloat16 weight to float32 as it loads, which is no faster than "
                           "float32 and can be slower (docs/kernels.md, AVX2); dtype auto keeps float32")
    return _DTYPES[dtype]


def check_supported(config: Any, model_cls: type | None = None) -> int | None:
    """Refuse models the paged attention cannot run exactly; return a sliding window, if any.

    A sliding-window model is accepted only with its context capped at the window, where
    windowed and full attention agree; the caller caps ``max_model_len`` to the returned size.

    Raises:
        UnsupportedModelError: naming the model type and the reason.
    """
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder; batchgen runs decoder-only models")
    if model_cls is not None and not getattr(model_cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model type {model_type!r} ({model_cls.__name__}) does not route attention through "
            "transformers' attention interface, so the paged cache cannot serve it")
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        raise UnsupportedModelError(f"model type {model_type!r} uses ALiBi position biases, which the paged attention does not apply")
    for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, attr, None):
            raise UnsupportedModelError(f"model type {model_type!r} uses attention logit soft-capping ({attr}), which the paged attention does not apply")
    if model_type in {"gpt_oss"}:
        raise UnsupportedModelError(f"model type {model_type!r} uses attention sinks, which the paged attention does not apply")
    window = None
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
    if uses_window or any("sliding" in str(t) for t in layer_types):
        window = getattr(config, "sliding_window", None)
        if not window:
            raise UnsupportedModelError(f"model type {model_type!r} has sliding-window layers without a window size")
    return int(window) if window else None


@dataclass
class LoadedModel:
    """A model ready to run: ``source`` (where it loaded from: ``source.path``), ``device``,
    ``dtype``, the HF ``model`` in eval mode, and ``window``, the sliding window its context is
    capped at (None: no window)."""

    source: ResolvedModel
    device: torch.device
    dtype: torch.dtype
    model: Any
    window: int | None


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve, check and load ``config.model`` (see the module docstring).

    Raises:
        UnsupportedModelError: a model the paged cache cannot run exactly.
    """
    # deferred: transformers (~3 s) loads with the first model, not with the engine's modules
    from transformers import AutoConfig, AutoModelForCausalLM

    device, trust_remote_code = config.device, config.trust_remote_code
    # a GGUF's weights load through batchgen.gguf, as config.quantization says
    source = resolve_model(config.model, config.quantization, device)
    model_path = source.path
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model_cls = _causal_lm_class(hf_config)
    window = check_supported(hf_config, model_cls)
    dtype = resolve_dtype(config.dtype, hf_config, torch_device)
    if source.gguf_file:
        # deferred: the GGUF loader (numpy, the gguf package) only for a GGUF model
        from batchgen.gguf.loader import load_gguf_model

        model = load_gguf_model(source.gguf_file, model_path, dtype=dtype, device=torch_device,
                                attn_implementation=paged_attention.register(),
                                quantization=source.quantization)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=paged_attention.register(),
            trust_remote_code=trust_remote_code,
        ).to(torch_device).eval()
    return LoadedModel(source, torch_device, dtype, model, window)


def _causal_lm_class(config: Any) -> type | None:
    """The class AutoModelForCausalLM would build for ``config`` (None if unknown)."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        if getattr(config, "is_encoder_decoder", False):
            return None
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} is not a causal language model "
            "that transformers' AutoModelForCausalLM can load")
