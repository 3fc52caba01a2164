"""``engine:`` the engine's settings (the YAML schema of
:class:`~batchgen.engine.config.EngineConfig`, which :meth:`EngineSection.to_engine_config`
builds), and ``executor:`` where the engine runs.

This module imports neither torch nor the engine (only the torch-free `engine/config.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import ByteSize, Field, PositiveInt, field_validator, model_validator

from batchgen.config.sections import _Section
from batchgen.engine.config import EngineConfig


class EngineSection(_Section):
    """``engine:`` the paged KV cache and scheduler knobs, passed to :class:`batchgen.LLM`."""

    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block (1..256)")
    kv_cache_memory: ByteSize | None = Field(
        None, gt=0, description="bytes, or a string like '512MiB'; null = the engine's default"
    )
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["prefix", "fcfs"] = Field(
        "prefix", description="order of waiting rows: 'prefix' runs rows that share a prompt prefix "
        "together (computed once); 'fcfs' keeps dataset order"
    )
    attention_backend: Literal["auto", "torch", "cpu", "cuda"] = "auto"
    linear_backend: Literal["auto", "torch", "cpu"] = Field(
        "auto", description="'cpu': the model's linear layers through batchgen's C GEMM; "
        "'auto' = 'cpu' on the CPU wherever it builds, else 'torch'"
    )
    num_threads: Literal["auto"] | PositiveInt = Field(
        "auto", description="CPU threads: 'auto' = OMP_NUM_THREADS if set, else the CPUs "
        "this process may use (affinity, cgroup quota)"
    )
    seed: int = Field(
        0, description="each record's sampling seed derives from it and the record id, so reruns and resumes repeat"
    )
    index_checks: bool = Field(
        True, description="the cuda attention backend checks context lengths, block ids and slots "
        "against the KV cache before launching (one host sync per step); false skips it"
    )
    quantization: Literal["auto", "gguf", "none"] = Field(
        "auto", description="how a GGUF model's weights load: 'gguf' keeps the file's quantized blocks "
        "(CPU), 'none' de-quantizes to the dtype; 'auto' = 'gguf' for a .gguf file on the CPU, 'none' "
        "on a GPU and for the built-in model (docs/gguf.md)"
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        # pydantic's ByteSize says "could not parse value and unit" for all of these.
        if isinstance(value, bool):
            raise ValueError(f"expected a size such as '512MiB' or a number of bytes, got {str(value).lower()}; "
                             "a boolean is not a size")
        negative = value < 0 if isinstance(value, (int, float)) else isinstance(value, str) and value.strip().startswith("-")
        if negative:
            raise ValueError(f"must be > 0 (got {value!r})")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"expected a whole number of bytes or a size such as '512MiB', got {value}")
        return value

    @field_validator("num_threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        # One message instead of pydantic's two (literal + constrained int) for the union.
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        hint = "; a boolean is not a count" if isinstance(value, bool) else ""
        raise ValueError(f"expected a positive integer or 'auto', got {shown}{hint}")

    def to_engine_config(self, model: Any) -> Any:
        """The :class:`~batchgen.engine.config.EngineConfig` of this section and the ``model``
        section: every field of this section that EngineConfig has, so a new engine setting is
        a field there plus its schema here."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        values = {key: getattr(self, key) for key in type(self).model_fields if key in names}
        if values.get("kv_cache_memory") is not None:
            values["kv_cache_memory"] = int(values["kv_cache_memory"])
        return EngineConfig(model=model.name, dtype=model.dtype, device=model.device, **values)


class ResourcesSection(_Section):
    """``executor.resources_per_replica:`` what Ray reserves for each engine replica."""

    num_cpus: float | None = Field(
        None, gt=0, description="CPU cores per replica, also its torch threads on the CPU; null = 1"
    )
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per replica; null = 1 on a cluster with GPUs, else 0"
    )


class ExecutorSection(_Section):
    """``executor:`` where the engine runs: in this process, or as replicas on a Ray cluster.

    See docs/scale-out.md. The Ray backend needs the ``ray`` extra (checked by
    :func:`batchgen.run.executors.check_executor`, not here: this module imports no optional package).
    """

    backend: Literal["local", "ray"] = "local"
    replicas: PositiveInt | Literal["auto"] = Field(
        1, description="engine replicas; 'auto' = one per GPU on a GPU cluster, else one per num_cpus cores"
    )
    address: str | None = Field(
        None, description="null = start a local Ray; 'auto' = join the cluster of this machine; "
        "'ray://host:port' (Ray Client) or 'host:port' (the head's GCS) = join that cluster"
    )
    resources_per_replica: ResourcesSection = Field(default_factory=ResourcesSection)

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas(cls, value: Any) -> Any:
        # One clear message instead of pydantic's two (int parsing + literal) for the union.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected a positive integer or 'auto', got {value!r}")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        rest = value[len("ray://"):] if value.startswith("ray://") else value
        host, sep, port = rest.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"invalid Ray address {value!r}; use null (start a local Ray), 'auto', "
                "'ray://host:port' (Ray Client, port 10001 by default) or 'host:port' (the head's GCS, port 6379)"
            )
        return value

    @model_validator(mode="after")
    def _local_is_one(self) -> ExecutorSection:
        if self.backend == "local":
            extra = [k for k in ("replicas", "address") if k in self.model_fields_set and getattr(self, k) not in (1, None)]
            if extra:
                keys = " and ".join(f"'{k}'" for k in extra)
                verb = "needs" if len(extra) == 1 else "need"
                raise ValueError(f"{keys} {verb} backend 'ray' (the local backend runs one engine in this process); "
                                 "set executor.backend: ray")
        return self
