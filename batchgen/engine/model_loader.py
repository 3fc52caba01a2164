"""Model loading: a model name becomes a ready model on its device, before the runner sees it.

:func:`load_model` resolves the name (:func:`batchgen.model_resolver.resolve_model`: a folder,
a hub id, a GGUF file or the embedded model), reads its HF config, refuses what the paged
cache cannot run exactly (:func:`check_supported`), settles the dtype (:func:`resolve_dtype`)
and loads the weights with batchgen's paged attention registered: a GGUF's through
:func:`batchgen.gguf.hf_model.load_gguf_model`, any other through transformers, on the device,
in eval mode. With ``linear_backend="cpu"`` it then fuses what a probe shows exact (RMSNorms,
gated MLPs and attention layers: :func:`batchgen.engine.fusion.fuse_model`) and packs the
remaining ``nn.Linear`` layers for the C GEMM (:func:`place_linears`). It settles the engine's
context too (:func:`context_length`).

The :class:`LoadedModel` knows its KV cache's shape (:func:`cache_shape`); whoever
builds the engine sizes the cache from it (:func:`batchgen.engine.kv_cache.num_blocks_for_budget`)
and hands both to :class:`~batchgen.engine.model_runner.ModelRunner`, which picks the attention
backend and runs the steps (:func:`batchgen.engine.llm.load_runner`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.engine import fusion, paged_attention, soft_cap
from batchgen.engine.config import DTYPE_NAMES, EngineConfig, dtype_error
from batchgen.engine.kv_cache import CacheShape, check_utilization_device
from batchgen.gguf.hf_model import load_gguf_model
from batchgen.kernels.cpu import c_build, fused as cpu_fused, linear as cpu_linear
from batchgen.model_resolver import ResolvedModel, resolve_model
from batchgen.quiet import progress_bars_off

__all__ = ["LAYER_TYPES", "LoadedModel", "UnsupportedModelError", "cache_shape", "check_supported", "context_length", "expected_windows",
           "load_model", "place_linears", "resolve_dtype"]

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
        if c_build.missing_cpu_features("avx512f") and c_build.missing_cpu_features("avx512_bf16"):
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
    ``dtype``, the HF ``model`` in eval mode, its ``linear_backend`` (its layers fused and packed
    for it), ``max_model_len`` (the engine's context: :func:`context_length`) and
    ``cache_shape``, the shape of its KV cache's blocks."""

    source: ResolvedModel
    device: torch.device
    dtype: torch.dtype
    model: Any
    linear_backend: str
    max_model_len: int
    cache_shape: CacheShape

    @property
    def text_config(self) -> Any:
        """The HF config of the language model (a multimodal config's text part)."""
        return _text_config(self.model)


def cache_shape(text_config: Any, block_size: int, dtype: torch.dtype) -> CacheShape:
    """The shape of a KV cache for the model of ``text_config``, ``block_size`` tokens a block."""
    num_heads = text_config.num_attention_heads
    return CacheShape(
        num_layers=text_config.num_hidden_layers,
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
        head_size=getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads,
        block_size=block_size, dtype=dtype,
    )


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _device(setting: str) -> torch.device:
    """The device ``device`` names; ``auto``: a GPU when there is one, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def context_length(asked: int | None, model_len: int) -> int:
    """The engine's context: ``max_model_len`` when set (at most the model's own), as vLLM."""
    if asked is None:
        return model_len
    if asked > model_len:
        raise ValueError(f"max_model_len={asked} is more than this model's context of {model_len} "
                         f"tokens (its max_position_embeddings); use at most {model_len}")
    return asked


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve, check and load ``config.model``, and place its linear layers (see the module
    docstring).

    Raises:
        UnsupportedModelError: a model the paged cache cannot run exactly.
        ValueError: ``max_model_len`` beyond the model's context, ``gpu_memory_utilization``
            off a GPU.
    """
    with progress_bars_off():  # transformers' bars ("Loading weights") are no output of ours
        return _loaded(config)


def _loaded(config: EngineConfig) -> LoadedModel:
    """:func:`load_model`'s steps, in their order."""
    # a GGUF's weights load through batchgen.gguf, as config.quantization says
    source = resolve_model(config.model, config.quantization, config.device)
    device = _device(config.device)
    check_utilization_device(device, config.gpu_memory_utilization)  # before the weights load
    model, dtype = _read_weights(source, config, device)
    text_config = _text_config(model)
    max_model_len = context_length(config.max_model_len, getattr(text_config, "max_position_embeddings", None) or 2048)
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device, source.quantization)
    shape = cache_shape(text_config, config.block_size, kv_dtype)
    linear_backend = place_linears(model, config.linear_backend, device, dtype)
    soft_cap.cap_in_place(model, text_config)  # after the packing: it wraps the placed head
    return LoadedModel(source, device, dtype, model, linear_backend, max_model_len, shape)


def kv_cache_dtype(setting: str, dtype: torch.dtype, device: torch.device, quantization: str = "none") -> torch.dtype:
    """The KV cache's dtype for the ``kv_cache_dtype`` setting. ``auto`` is the model's dtype,
    but float16 for a float32 model in the ``gguf`` mode on the CPU (llama.cpp's default cache
    type: half the KV memory and half the bytes a decode step's attention reads). A 16-bit
    cache is taken under a float32 model on the CPU only: the attention kernel widens its rows
    exactly and every sum stays float32; writing them needs AVX2 and F16C.

    Raises:
        ValueError: a cache dtype other than the model's for a 16-bit model, on a GPU, or on a
            CPU without the 16-bit conversions.
    """
    on_cpu_16 = dtype == torch.float32 and device.type == "cpu"
    if setting == "auto":
        gguf_default = on_cpu_16 and quantization == "gguf" and cpu_fused.supported(torch.float16)
        return torch.float16 if gguf_default else dtype
    kv = _DTYPES[setting]
    if kv == dtype:
        return kv
    if dtype != torch.float32 or kv == torch.float32:
        raise ValueError(f"kv_cache_dtype {setting!r} under a {str(dtype).removeprefix('torch.')} model: a "
                         "16-bit model keeps its KV in its own dtype; use kv_cache_dtype: auto")
    if not on_cpu_16:
        raise ValueError(f"kv_cache_dtype {setting!r} runs on the CPU only (the CUDA kernels take the model's "
                         "dtype); use kv_cache_dtype: auto")
    if not cpu_fused.supported(kv):
        raise ValueError(f"kv_cache_dtype {setting!r} needs a CPU with AVX2 and F16C (the 16-bit conversions); "
                         "use kv_cache_dtype: auto")
    return kv


def _read_weights(source: ResolvedModel, config: EngineConfig, device: torch.device) -> tuple[Any, torch.dtype]:
    """The HF model of ``source`` on ``device`` in eval mode, after its config's checks, and its dtype."""
    model_path, trust_remote_code = source.path, config.trust_remote_code
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model_cls = _causal_lm_class(hf_config)
    check_supported(hf_config, model_cls)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    if source.gguf_file:
        model = load_gguf_model(source.gguf_file, model_path, dtype=dtype, device=device,
                                attn_implementation=paged_attention.register(),
                                quantization=source.quantization)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=paged_attention.register(),
            trust_remote_code=trust_remote_code,
        ).to(device).eval()
    return model, dtype


def place_linears(model: Any, name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve ``linear_backend`` and, for ``cpu``, fuse what a probe shows exact (RMSNorms,
    gated MLPs and attention layers, over ``nn.Linear`` or ``QuantizedLinear`` layers:
    :func:`batchgen.engine.fusion.fuse_model`), then pack the model's remaining
    ``nn.Linear`` layers for the C GEMM; the backend resolved."""
    backend, why = cpu_linear.resolve(name, device, dtype)
    if backend == "cpu":
        fused = fusion.fuse_model(model)  # before packing: it merges gate+up and q+k+v
        count = cpu_linear.pack_linears(model)
        path = f", bfloat16 through {cpu_linear.bf16_path()}" if dtype == torch.bfloat16 else ""
        logger.info("linear backend cpu: %d layers packed for the C GEMM%s; fused %d RMSNorms, "
                    "%d gated MLPs, %d attention layers and %d decoder layers (%d candidates left as they were)",
                    count, path, fused["rms_norm"], fused["gated_mlp"], fused["attention"], fused["decoder_layer"],
                    fused["rejected"])
        if fused["decoder"]:
            logger.info("the decoder runs the engine's steps by its lean forward (engine/fused_decoder.py)")
    elif why is not None and device.type == "cpu":
        # the C kernels would have carried the step: say plainly why they do not
        logger.warning("linear backend torch (the C kernels cannot run here): %s", why.splitlines()[0])
    return backend


def _causal_lm_class(config: Any) -> type | None:
    """The class AutoModelForCausalLM would build for ``config`` (None if unknown)."""
    mapping = AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        if getattr(config, "is_encoder_decoder", False):
            return None
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} is not a causal language model "
            "that transformers' AutoModelForCausalLM can load")
