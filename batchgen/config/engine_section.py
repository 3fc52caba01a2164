"""``engine:`` the engine's settings, derived from
:class:`~batchgen.engine.config.EngineConfig` (its fields' types, defaults, bounds, meanings and
checks), and ``executor:`` where the engine runs.

:class:`EngineSection` is built from ``dataclasses.fields(EngineConfig)`` (all but
:data:`~batchgen.engine.config.MODEL_KEYS`, which the ``model:`` section gives): a new engine
setting is a field of EngineConfig and appears here by itself. What a job file spells its own
way is :data:`YAML_TYPES` (a size such as ``'512MiB'``; a seed that is always set) and the
friendlier messages of the ``_size`` / ``_threads`` validators.

This module imports neither torch nor the engine (only the torch-free `engine/config.py`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import ByteSize, Field, PositiveInt, ValidationInfo, create_model, field_validator, model_validator

from batchgen.config.sections import _Section
from batchgen.engine.config import MODEL_KEYS, EngineConfig, field_error, utilization_error

#: The YAML's own type of a setting where a job file spells it otherwise than Python does.
YAML_TYPES: dict[str, Any] = {
    "kv_cache_memory": ByteSize | None,
    "seed": int,  # always set in a job: resumes need the records' seeds to repeat
}
#: The YAML's own default of a setting where a job wants another than Python's (vLLM's) one: a
#: job sweeping a folder of checkpoints runs several adapters in one batch, at their ranks.
YAML_DEFAULTS: dict[str, Any] = {"max_loras": 8, "max_lora_rank": 64}


class _EngineChecks(_Section):
    """The checks of :class:`EngineSection` (its fields come from EngineConfig)."""

    @field_validator("kv_cache_memory", mode="before", check_fields=False)
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

    @field_validator("num_threads", mode="before", check_fields=False)
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

    @field_validator("*", check_fields=False)
    @classmethod
    def _engine_check(cls, value: Any, info: ValidationInfo) -> Any:
        # The engine's own check, after the schema's type and bounds (e.g. tensor_parallel_size).
        name = info.field_name
        error = field_error(name, int(value) if name == "kv_cache_memory" and value is not None else value)
        if error is not None:
            raise ValueError(error)
        return value

    @model_validator(mode="after")
    def _one_kv_budget(self) -> Any:
        error = utilization_error(getattr(self, "gpu_memory_utilization"), getattr(self, "kv_cache_memory"))
        if error is not None:
            raise ValueError(error)
        return self

    def to_engine_config(self, model: Any) -> EngineConfig:
        """The :class:`~batchgen.engine.config.EngineConfig` of this section and the ``model``
        section."""
        values = {key: getattr(self, key) for key in type(self).model_fields}
        if values.get("kv_cache_memory") is not None:
            values["kv_cache_memory"] = int(values["kv_cache_memory"])
        values["enable_lora"] = bool(getattr(model, "adapters", None))  # model.adapters: LoRA on
        values["enable_lora"] = values.get("enable_lora") or bool(getattr(model, "adapters", None))
        return EngineConfig(model=model.name, dtype=model.dtype, device=model.device, **values)


def _schema_field(field: dataclasses.Field, hint: Any) -> tuple[Any, Any]:
    """``(type, pydantic Field)`` of one EngineConfig field in the YAML."""
    return (YAML_TYPES.get(field.name, hint),
            Field(YAML_DEFAULTS.get(field.name, field.default), description=field.metadata.get("doc"),
                  **field.metadata.get("bounds", {})))


def _engine_section() -> type[_EngineChecks]:
    hints = typing.get_type_hints(EngineConfig)
    fields = {f.name: _schema_field(f, hints[f.name]) for f in dataclasses.fields(EngineConfig)
              if f.name not in MODEL_KEYS}
    return create_model("EngineSection", __base__=_EngineChecks, __module__=__name__,
                        __doc__="``engine:`` the paged KV cache and scheduler knobs, passed to "
                                ":class:`batchgen.LLM` (derived from EngineConfig).", **fields)


EngineSection = _engine_section()


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
