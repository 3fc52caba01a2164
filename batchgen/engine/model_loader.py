"""Model loading: a model name becomes a ready model on its device, before the runner sees it.

:func:`load_model` resolves the name (:func:`batchgen.model_resolver.resolve_model`: a folder,
a hub id, a GGUF file or the embedded model), reads its HF config, refuses what the paged
cache cannot run exactly (:func:`check_supported`), settles the dtype (:func:`resolve_dtype`)
and loads the weights with batchgen's paged attention registered: a GGUF's through
:func:`batchgen.gguf.hf_model.load_gguf_model`, any other through transformers, on the device,
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
from batchgen.engine.kv_cache import check_utilization_device
from batchgen.model_resolver import ResolvedModel, resolve_model

__all__ = ["LAYER_TYPES", "LoadedModel", "UnsupportedModelError", "check_supported", "expected_windows", "load_model",
           "resolve_dtype"]

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
        from batchgen.kernels.cpu.c_build import missing_cpu_features

        if missing_cpu_features("avx512f") and missing_cpu_features("avx512_bf16"):
            logger.warning("dtype bfloat16 on a CPU without AVX-512 or AVX512-BF16: the linear layers "
                           "widen every bfloat16 weight to float32 as it loads, which is no faster than "
                           "float32 and can be slower (docs/kernels.md, AVX2); dtype auto keeps float32")
    return _DTYPES[dtype]


# The layer types (HF's ``config.layer_types``) the paged attention runs: causal attention over
# all of a sequence's positions, or over the last ``sliding_window`` of them.
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(config: Any, model_cls: type | None = None) -> None:
    """Refuse models the paged attention cannot run exactly.

    Sliding-window layers (each layer's window as HF passes it to the attention interface) and
    attention logit soft-capping run in the paged attention; what the model passes is checked
    against its config on the first step (:func:`expected_windows`).

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
    if model_type in {"gpt_oss"}:
        raise UnsupportedModelError(f"model type {model_type!r} uses attention sinks, which the paged attention does not apply")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModelError(f"model type {model_type!r} uses chunked attention (attention_chunk_size), which the paged attention does not apply")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"model type {model_type!r} uses bidirectional attention, which the paged (causal) attention does not apply")
    other = sorted({str(t) for t in getattr(config, "layer_types", None) or []} - set(LAYER_TYPES))
    if other:
        raise UnsupportedModelError(f"model type {model_type!r} has {', '.join(other)} layers; the paged attention runs {' and '.join(LAYER_TYPES)} layers")
    if any(w is not None and w < 1 for w in expected_windows(config)):
        raise UnsupportedModelError(f"model type {model_type!r} has sliding-window layers without a window size")


def expected_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window as HF's masks apply it (None: a global layer): from
    ``layer_types`` where the config has them, else ``sliding_window`` for every layer unless
    ``use_sliding_window`` is false (Mistral, Phi-3)."""
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [int(window or 0) if t == "sliding_attention" else None for t in layer_types]
    if window and getattr(config, "use_sliding_window", True):
        return [int(window)] * num_layers
    return [None] * num_layers


@dataclass
class LoadedModel:
    """A model ready to run: ``source`` (where it loaded from: ``source.path``), ``device``,
    ``dtype`` and the HF ``model`` in eval mode."""

    source: ResolvedModel
    device: torch.device
    dtype: torch.dtype
    model: Any


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
    check_utilization_device(torch_device, config.gpu_memory_utilization)  # before the weights load
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model_cls = _causal_lm_class(hf_config)
    check_supported(hf_config, model_cls)
    dtype = resolve_dtype(config.dtype, hf_config, torch_device)
    if source.gguf_file:
        # deferred: the GGUF loader (numpy, the gguf package) only for a GGUF model
        from batchgen.gguf.hf_model import load_gguf_model

        model = load_gguf_model(source.gguf_file, model_path, dtype=dtype, device=torch_device,
                                attn_implementation=paged_attention.register(),
                                quantization=source.quantization)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=paged_attention.register(),
            trust_remote_code=trust_remote_code,
        ).to(torch_device).eval()
    return LoadedModel(source, torch_device, dtype, model)


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
