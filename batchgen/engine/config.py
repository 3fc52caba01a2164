"""EngineConfig: every setting of one engine, in one torch-free dataclass.

The YAML's ``model``/``engine`` sections build it, executors ship it to their replicas,
:class:`batchgen.LLM` takes it (``LLM(config=...)``; ``LLM(model, dtype=..., ...)`` keyword
arguments build one), and :class:`batchgen.engine.model_runner.ModelRunner` reads it. A new
engine setting is a new field here (plus its YAML schema); its values are checked once, in
:meth:`EngineConfig.__post_init__`, so every layer below receives a valid object.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from batchgen.model_resolver import DEFAULT_MODEL

__all__ = ["EngineConfig", "DTYPE_NAMES", "ATTENTION_BACKENDS", "LINEAR_BACKENDS",
           "SCHEDULING_POLICIES", "QUANTIZATIONS"]

#: dtype names accepted by ``dtype`` (besides ``"auto"``) -> the torch dtype's attribute name.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
ATTENTION_BACKENDS = ("auto", "cpu", "cuda", "torch")
LINEAR_BACKENDS = ("auto", "cpu", "torch")
SCHEDULING_POLICIES = ("prefix", "fcfs")
#: ``auto``: the weights as stored (a ``.gguf`` file's own quantization; how the embedded model
#: loads is decided by the model loader); ``gguf``: keep a GGUF file's quantized weights;
#: ``none``: dequantize to ``dtype``.
QUANTIZATIONS = ("auto", "gguf", "none")
MAX_BLOCK_SIZE = 256
MAX_LORA_RANK = 1024

_DEVICE = re.compile(r"^[a-z]+(:\d+)?$")


def dtype_error(dtype: object) -> str | None:
    """Why ``dtype`` is not a dtype name, or None."""
    if dtype == "auto" or dtype in DTYPE_NAMES:
        return None
    return f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(DTYPE_NAMES))}"


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class EngineConfig:
    """The settings of one engine (vLLM's names).

    Attributes:
        model: a local HF folder, a hub id, or a built-in alias (default: the embedded
            SmolLM2-135M-Instruct).
        dtype: ``"auto"`` (float32 on CPU, the checkpoint's dtype on GPU), ``"float32"``,
            ``"float16"``, ``"bfloat16"`` (or ``fp32``, ``fp16``, ``half``, ``bf16``).
        device: ``"auto"`` (cuda when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        block_size: tokens per KV block (1..256).
        kv_cache_memory: KV budget in bytes (None: 0.9 of free GPU memory, 512 MiB on CPU).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        enable_prefix_caching: share full prompt blocks across requests.
        scheduling_policy: the order of waiting requests: ``"prefix"`` (requests sharing a
            prompt prefix run together, so that it is computed once) or ``"fcfs"`` (arrival
            order). Either way ``generate`` returns outputs in input order.
        attention_backend: ``"auto"``, ``"torch"``, ``"cpu"`` or ``"cuda"``.
        linear_backend: ``"auto"``, ``"torch"`` or ``"cpu"``: the model's linear layers through
            batchgen's CPU GEMM (``auto``: on the CPU wherever it builds).
        seed: derives a per-request seed for requests that give none, so whole runs repeat;
            None leaves unseeded requests to the global RNG.
        trust_remote_code: passed to transformers' ``from_pretrained``.
        num_threads: CPU threads, ``"auto"`` (``OMP_NUM_THREADS`` if set, else the CPUs this
            process may use: affinity and cgroup quota) or a count; see :mod:`batchgen.threads`.
        index_checks: the ``cuda`` attention backend checks context lengths, block ids and
            slots against the cache before launching (one host sync per step); False skips
            it (the cpu backend checks always).
        quantization: ``"auto"`` (the weights as stored), ``"gguf"`` (keep a GGUF file's
            quantized weights) or ``"none"`` (dequantize to ``dtype``); the model loader
            decides what ``auto`` means for each model format.
        enable_lora: wrap the model's projections for LoRA adapters, given per request as a
            ``LoRARequest`` (see ``docs/lora.md``).
        max_loras: most adapters loaded (and running) at once; more are loaded as needed,
            the least recently used evicted.
        max_lora_rank: the largest adapter rank accepted (1..1024).

    Raises:
        ValueError: on construction, for any value out of range, naming the setting.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "prefix"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    seed: int | None = 0
    trust_remote_code: bool = False
    num_threads: int | str = "auto"
    index_checks: bool = True
    quantization: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        errors = [e for e in self._errors() if e is not None]
        if errors:
            raise ValueError("; ".join(errors))

    def _errors(self) -> list[str | None]:
        def choice(name: str, options: tuple[str, ...]) -> str | None:
            value = getattr(self, name)
            if value in options:
                return None
            return f"{name} must be one of {', '.join(options)}; got {value!r}"

        def flag(name: str) -> str | None:
            value = getattr(self, name)
            return None if isinstance(value, bool) else f"{name} must be true or false, got {value!r}"

        def positive(name: str) -> str | None:
            value = getattr(self, name)
            return None if _positive_int(value) else f"{name} must be an integer >= 1, got {value!r}"

        bs = self.block_size
        kv = self.kv_cache_memory
        return [
            None if isinstance(self.model, str) and self.model else f"model must be a non-empty string, got {self.model!r}",
            dtype_error(self.dtype),
            None if isinstance(self.device, str) and _DEVICE.match(self.device)
            else f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
            None if _positive_int(bs) and bs <= MAX_BLOCK_SIZE
            else f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {bs}",
            None if kv is None or _positive_int(kv)
            else f"kv_cache_memory must be a number of bytes > 0 (or None for the default), got {kv!r}",
            positive("max_num_seqs"),
            positive("max_num_batched_tokens"),
            flag("enable_prefix_caching"),
            choice("scheduling_policy", SCHEDULING_POLICIES),
            choice("attention_backend", ATTENTION_BACKENDS),
            choice("linear_backend", LINEAR_BACKENDS),
            None if self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool))
            else f"seed must be an integer or None, got {self.seed!r}",
            flag("trust_remote_code"),
            None if self.num_threads == "auto" or _positive_int(self.num_threads)
            else f"num_threads must be 'auto' or an integer >= 1, got {self.num_threads!r}",
            flag("index_checks"),
            choice("quantization", QUANTIZATIONS),
            flag("enable_lora"),
            positive("max_loras"),
            None if _positive_int(self.max_lora_rank) and self.max_lora_rank <= MAX_LORA_RANK
            else f"max_lora_rank must be between 1 and {MAX_LORA_RANK}, got {self.max_lora_rank!r}",
        ]

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
