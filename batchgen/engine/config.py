"""EngineConfig: every setting of one engine, in one torch-free dataclass.

The YAML's ``model``/``engine`` sections build it, executors ship it to their replicas,
:class:`batchgen.LLM` takes it (``LLM(config=...)``; ``LLM(model, dtype=..., ...)`` keyword
arguments build one), and :class:`batchgen.engine.model_runner.ModelRunner` reads it. A new
engine setting is a new field here (``_setting``: its default, meaning and bounds) and its check
in ``_CHECKS``; the YAML ``engine:`` section is derived from the fields
(:mod:`batchgen.config.engine_section`). Values are checked once, in
:meth:`EngineConfig.__post_init__`, so every layer below receives a valid object.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from batchgen.backends import AttentionBackend, LinearBackend
from batchgen.model_resolver import DEFAULT_MODEL, QUANTIZATIONS, Quantization

__all__ = ["EngineConfig", "DTYPE_NAMES", "ATTENTION_BACKENDS", "LINEAR_BACKENDS",
           "SCHEDULING_POLICIES", "QUANTIZATIONS", "AttentionBackend", "LinearBackend",
           "SchedulingPolicy", "Quantization", "field_error", "MODEL_KEYS"]

#: dtype names accepted by ``dtype`` (besides ``"auto"``) -> the torch dtype's attribute name.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
#: The choices, each spelled once; other modules read them with ``typing.get_args``.
SchedulingPolicy = Literal["prefix", "fcfs"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
LINEAR_BACKENDS: tuple[str, ...] = get_args(LinearBackend)
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
MAX_BLOCK_SIZE = 256
#: The settings a job gives in its ``model:`` section (or not at all), not in ``engine:``.
MODEL_KEYS = ("model", "dtype", "device", "trust_remote_code")
MAX_LORA_RANK = 1024

_DEVICE = re.compile(r"^[a-z]+(:\d+)?$")


def dtype_error(dtype: object) -> str | None:
    """Why ``dtype`` is not a dtype name, or None."""
    if dtype == "auto" or dtype in DTYPE_NAMES:
        return None
    return f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(DTYPE_NAMES))}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: object) -> bool:
    return _is_int(value) and value >= 1  # type: ignore[operator]


def _setting(default: Any, doc: str, **bounds: float) -> Any:
    """A field of :class:`EngineConfig`: its default, what it means (the YAML's description),
    and its numeric bounds (``ge``, ``le``, ``gt``: the YAML schema's constraints, which the
    field's check in :data:`_CHECKS` states in words)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "bounds": bounds})


def tensor_parallel_error(size: object) -> str | None:
    """Why ``tensor_parallel_size`` cannot be ``size``, or None (it is 1)."""
    if size == 1 and _positive_int(size):
        return None
    if _positive_int(size):
        return (f"tensor_parallel_size={size} is not supported: batchgen runs one model per device; "
                "to use several devices run data-parallel replicas on Ray (a job's executor.backend: ray "
                "and executor.replicas: N; docs/scale-out.md), and keep tensor_parallel_size=1")
    return f"tensor_parallel_size must be 1, got {size!r}"


def utilization_error(utilization: object, kv_cache_memory: object) -> str | None:
    """Why ``gpu_memory_utilization`` cannot be ``utilization`` beside ``kv_cache_memory``."""
    if utilization is None:
        return None
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        return f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}"
    if kv_cache_memory is not None:
        return ("give one of gpu_memory_utilization (a fraction of the GPU's memory) and "
                "kv_cache_memory (bytes), not both")
    return None


def _choice(name: str, options: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else f"{name} must be one of {', '.join(options)}; got {v!r}"


def _flag(name: str) -> Callable[[Any], str | None]:
    return lambda v: None if isinstance(v, bool) else f"{name} must be true or false, got {v!r}"


def _positive(name: str, optional: bool = False) -> Callable[[Any], str | None]:
    return lambda v: None if (optional and v is None) or _positive_int(v) else f"{name} must be an integer >= 1, got {v!r}"


#: Each setting's check: the value -> why it is refused, or None. The one place a value is judged.
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "model": lambda v: None if isinstance(v, str) and v else f"model must be a non-empty string, got {v!r}",
    "dtype": dtype_error,
    "kv_cache_dtype": lambda v: None if v == "auto" or v in DTYPE_NAMES
    else f"unknown kv_cache_dtype {v!r}; choose one of auto, {', '.join(sorted(DTYPE_NAMES))}",
    "device": lambda v: None if isinstance(v, str) and _DEVICE.match(v)
    else f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}",
    "block_size": lambda v: None if _positive_int(v) and v <= MAX_BLOCK_SIZE
    else f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {v}",
    "kv_cache_memory": lambda v: None if v is None or _positive_int(v)
    else f"kv_cache_memory must be a number of bytes > 0 (or None for the default), got {v!r}",
    "max_num_seqs": _positive("max_num_seqs"),
    "max_num_batched_tokens": _positive("max_num_batched_tokens"),
    "enable_prefix_caching": _flag("enable_prefix_caching"),
    "scheduling_policy": _choice("scheduling_policy", SCHEDULING_POLICIES),
    "attention_backend": _choice("attention_backend", ATTENTION_BACKENDS),
    "linear_backend": _choice("linear_backend", LINEAR_BACKENDS),
    "seed": lambda v: None if v is None or _is_int(v) else f"seed must be an integer or None, got {v!r}",
    "trust_remote_code": _flag("trust_remote_code"),
    "num_threads": lambda v: None if v == "auto" or _positive_int(v)
    else f"num_threads must be 'auto' or an integer >= 1, got {v!r}",
    "index_checks": _flag("index_checks"),
    "quantization": _choice("quantization", QUANTIZATIONS),
    "tokenizer": lambda v: None if v is None or (isinstance(v, str) and v)
    else f"tokenizer must be a folder or hub id (or None for the model's), got {v!r}",
    "max_model_len": _positive("max_model_len", optional=True),
    "max_logprobs": lambda v: None if _is_int(v) and v >= -1
    else f"max_logprobs must be an integer >= 0 (or -1: no cap), got {v!r}",
    "tensor_parallel_size": tensor_parallel_error,
    "gpu_memory_utilization": lambda v: utilization_error(v, None),
    "enable_lora": _flag("enable_lora"),
    "max_loras": _positive("max_loras"),
    "max_lora_rank": lambda v: None if _positive_int(v) and v <= MAX_LORA_RANK
    else f"max_lora_rank must be between 1 and {MAX_LORA_RANK}, got {v!r}",
}


def field_error(name: str, value: Any) -> str | None:
    """Why setting ``name`` cannot be ``value`` on its own, or None (the YAML's ``engine:``
    section runs the same check)."""
    return _CHECKS[name](value)


@dataclass(frozen=True)
class EngineConfig:
    """The settings of one engine (vLLM's names): each field's default and meaning are below
    (the YAML ``engine:`` section is derived from these fields: its types, defaults and
    descriptions; see :mod:`batchgen.config.engine_section`).

    Attributes:
        model: a local HF folder, a hub id, or a built-in alias (default: the embedded
            SmolLM2-135M-Instruct).
        dtype: ``"auto"`` (float32 on CPU, the checkpoint's dtype on GPU), ``"float32"``,
            ``"float16"``, ``"bfloat16"`` (or ``fp32``, ``fp16``, ``half``, ``bf16``).
        device: ``"auto"`` (cuda when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        trust_remote_code: passed to transformers' ``from_pretrained``.
        others: each field's meaning (its ``doc``, listed under "Settings" below).

    Raises:
        ValueError: on construction, for any value out of range, naming the setting (every
            error at once).
    """

    model: str = _setting(DEFAULT_MODEL, "model name, alias or local HF folder")
    dtype: str = _setting("auto", "'auto', 'float32', 'float16', 'bfloat16'")
    device: str = _setting("auto", "'auto', 'cpu', 'cuda' or 'cuda:N'")
    block_size: int = _setting(16, "tokens per KV block (1..256)", ge=1, le=MAX_BLOCK_SIZE)
    kv_cache_dtype: str = _setting(
        "auto", "'auto' (the model's dtype; float16 for a float32 model in the gguf mode on the CPU, as "
        "llama.cpp), or 'bfloat16' / 'float16' under a float32 model on the CPU: half the KV memory, and "
        "half the bytes a decode step's attention reads (docs/kernels.md)")
    kv_cache_memory: int | None = _setting(
        None, "KV budget in bytes (a string like '512MiB' in a job); null = 0.9 of the free GPU memory, "
        "512 MiB on the CPU", gt=0)
    max_num_seqs: int = _setting(256, "most sequences running at once", gt=0)
    max_num_batched_tokens: int = _setting(2048, "token budget of one step (prefill chunks + decodes)", gt=0)
    enable_prefix_caching: bool = _setting(True, "share full prompt blocks across requests")
    scheduling_policy: SchedulingPolicy = _setting(
        "prefix", "order of waiting requests: 'prefix' runs those that share a prompt prefix together "
        "(computed once); 'fcfs' keeps arrival order. Outputs come back in input order either way")
    attention_backend: AttentionBackend = _setting("auto", "'auto', 'cpu', 'cuda' or 'torch' (docs/kernels.md)")
    linear_backend: LinearBackend = _setting(
        "auto", "'cpu': the model's linear layers through batchgen's C GEMM; 'auto' = 'cpu' on the CPU "
        "wherever it builds, else 'torch'")
    seed: int | None = _setting(
        0, "each request's sampling seed derives from it and the request id, so reruns and resumes "
        "repeat; None leaves unseeded requests to the global RNG")
    trust_remote_code: bool = _setting(False, "passed to transformers' from_pretrained")
    num_threads: int | Literal["auto"] = _setting(
        "auto", "CPU threads: 'auto' = OMP_NUM_THREADS if set, else the CPUs this process may use "
        "(affinity, cgroup quota); or a count (batchgen.threads)")
    index_checks: bool = _setting(
        True, "the cuda attention backend checks context lengths, block ids and slots against the KV "
        "cache before launching (one host sync per step); false skips it")
    quantization: Quantization = _setting(
        "auto", "how a GGUF model's weights load: 'gguf' keeps the file's quantized blocks (CPU), 'none' "
        "de-quantizes to the dtype; 'auto' = 'gguf' for a .gguf file on the CPU, 'none' on a GPU and "
        "for the built-in model (docs/gguf.md)")
    tokenizer: str | None = _setting(None, "the tokenizer's folder or hub id; null = the model's own")
    max_model_len: int | None = _setting(
        None, "the context in tokens (prompt plus generated), at most the model's own; a prompt that "
        "leaves no room for a generated token is refused, and generation ends there, as in vLLM; "
        "null = the model's", gt=0)
    max_logprobs: int = _setting(20, "the most logprobs / prompt_logprobs a request may ask for; -1 = no cap",
                                 ge=-1)
    tensor_parallel_size: int = _setting(
        1, "1 only (vLLM's setting): batchgen runs one model per device; several devices run as "
        "data-parallel replicas on Ray (executor.backend: ray)")
    gpu_memory_utilization: float | None = _setting(
        None, "on a GPU, the fraction of its memory the engine may fill (the KV cache gets what the "
        "model and other processes leave); null = 0.9 of the free memory; not on the CPU (use "
        "kv_cache_memory)", gt=0, le=1)
    enable_lora: bool = _setting(False, "wrap the model's projections for LoRA adapters, given per request as a "
                                 "LoRARequest (docs/lora.md); a job turns it on with model.adapters")
    max_loras: int = _setting(1, "most LoRA adapters loaded (and running) at once; more load as needed, the "
                              "least recently used evicted", ge=1)
    max_lora_rank: int = _setting(16, f"the largest LoRA adapter rank accepted (1..{MAX_LORA_RANK})", ge=1,
                                  le=MAX_LORA_RANK)

    def __post_init__(self) -> None:
        errors = [e for e in self._errors() if e is not None]
        if errors:
            raise ValueError("; ".join(errors))

    def _errors(self) -> list[str | None]:
        errors = [check(getattr(self, name)) for name, check in _CHECKS.items()]
        both = field_error("gpu_memory_utilization", self.gpu_memory_utilization) is None and utilization_error(
            self.gpu_memory_utilization, self.kv_cache_memory)
        return [*errors, both or None]

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (for logs, summaries, and shipping to a replica)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """``EngineConfig(**kwargs)``, with a TypeError naming every unknown setting."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; the settings are: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if model is not None:
            kwargs["model"] = model
        return cls(**kwargs)


# help(EngineConfig) lists every setting's meaning from the one place it is written.
EngineConfig.__doc__ = (EngineConfig.__doc__ or "") + "\n    Settings:\n" + "\n".join(
    f"        {f.name} (default {f.default!r}): {f.metadata['doc']}" for f in dataclasses.fields(EngineConfig))
