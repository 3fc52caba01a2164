"""LoRAAdapter: one PEFT LoRA folder, read and checked against the base model's projections.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (what PEFT's
``save_pretrained`` writes). :meth:`LoRAAdapter.open` reads the config and the tensors' shapes
only (no weights), and checks every module against the model: this is what runs when a request
arrives, so that a bad adapter fails its requests at once with an error naming it.
:meth:`LoRAAdapter.load` reads the weights, when the adapter first takes a slot.

Scaling, as PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; per
module, ``rank_pattern`` and ``alpha_pattern`` override ``r`` and ``lora_alpha`` (the rank is
read from the tensors' shapes, which PEFT writes with the pattern's rank).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
# Config settings that change what the adapter computes, and the value batchgen applies.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


class LoRAError(ValueError):
    """An adapter that cannot run on this model; the message names the adapter and a fix."""


@dataclass(frozen=True)
class ModuleDelta:
    """What one targeted module adds: ``scale * (x @ A.T) @ B.T``; ``A`` is ``[rank, in]``,
    ``B`` is ``[out, rank]`` (PEFT's ``lora_A.weight`` / ``lora_B.weight``), float32."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key matching the end of ``module``'s name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass
class LoRAAdapter:
    """A checked adapter: its name and id, its folder, and per targeted module (names as the
    model's ``named_modules``) the rank and the scale."""

    name: str
    int_id: int
    path: Path
    ranks: dict[str, int]
    scales: dict[str, float]

    def error(self, what: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {self.name!r} ({self.path}): {what}")

    @classmethod
    def open(cls, name: str, int_id: int, path: str | Path, shapes: dict[str, tuple[int, int]],
             max_rank: int) -> "LoRAAdapter":
        """Read and check the folder (config and tensor shapes, no weights).

        Args:
            shapes: every projection LoRA can target in this model: module name ->
                ``(in_features, out_features)``.
            max_rank: the engine's ``max_lora_rank``.

        Raises:
            LoRAError: no folder or files, a config batchgen does not apply (DoRA, biases,
                ``modules_to_save``...), a rank above ``max_rank``, a module the model does not
                have (or that LoRA does not target here), or shapes of another base model.
        """
        adapter = cls(name, int_id, Path(path), {}, {})
        config = adapter._read_config()
        tensors = adapter._tensor_shapes()
        adapter._check_targets(config, shapes)
        modules: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, shape in tensors.items():
            module, part = adapter._split_key(key)
            modules.setdefault(module, {})[part] = shape
        if not modules:
            raise adapter.error(f"{WEIGHTS_FILE} holds no lora_A/lora_B weights")
        rslora = bool(config.get("use_rslora", False))
        for module, parts in sorted(modules.items()):
            rank = adapter._check_module(module, parts, shapes, max_rank)
            alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
            adapter.ranks[module] = rank
            adapter.scales[module] = alpha / math.sqrt(rank) if rslora else alpha / rank
        return adapter

    def _read_config(self) -> dict[str, Any]:
        if not self.path.is_dir():
            raise self.error("no such adapter folder; give the folder PEFT's save_pretrained wrote")
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            if not (self.path / file).is_file():
                raise self.error(f"the folder has no {file} (a PEFT LoRA folder holds {CONFIG_FILE} "
                                 f"and {WEIGHTS_FILE})")
        try:
            config = json.loads((self.path / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise self.error(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
        if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise self.error(f"{CONFIG_FILE} is not a LoRA config (peft_type "
                             f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
        for key, applied in _UNSUPPORTED.items():
            if config.get(key, applied) not in (applied, None):
                raise self.error(f"{key}={config[key]!r} is not supported (batchgen applies {key}={applied!r})")
        if config.get("modules_to_save"):
            raise self.error(f"modules_to_save {config['modules_to_save']} is not supported "
                             "(batchgen applies the LoRA deltas only)")
        return config

    def _tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        try:
            with safe_open(str(self.path / WEIGHTS_FILE), framework="pt") as f:
                return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise self.error(f"{WEIGHTS_FILE} is not readable: {exc}") from None

    def _split_key(self, key: str) -> tuple[str, str]:
        for suffix, part in _SUFFIXES.items():
            if key.endswith(suffix):
                return key.removesuffix(suffix).removeprefix(_PREFIX), part
        raise self.error(f"tensor {key!r} is no lora_A/lora_B weight (embedding LoRA, DoRA "
                         "magnitudes and saved modules are not supported)")

    def _check_targets(self, config: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> None:
        """Each name in a list ``target_modules`` is the last part of some projection's name."""
        targets = config.get("target_modules")
        if not isinstance(targets, list):
            return  # a regex, "all-linear" or None: the tensors' module names are checked instead
        leaves = {name.rsplit(".", 1)[-1] for name in shapes}
        unknown = sorted(t for t in targets if t not in leaves and not any(n.endswith("." + t) for n in shapes))
        if unknown:
            raise self.error(f"target module(s) {', '.join(map(repr, unknown))}: this model has no such "
                             f"module that LoRA applies to (it applies to {', '.join(sorted(leaves))})")

    def _check_module(self, module: str, parts: dict[str, tuple[int, ...]],
                      shapes: dict[str, tuple[int, int]], max_rank: int) -> int:
        """The module's rank, once its two weights fit the model's projection."""
        if module not in shapes:
            raise self.error(f"module {module!r} is not a projection of this model that LoRA applies "
                             f"to (q/k/v/o and gate/up/down projections: e.g. {next(iter(shapes), '?')!r})")
        if set(parts) != {"A", "B"} or len(parts["A"]) != 2 or len(parts["B"]) != 2:
            raise self.error(f"module {module!r} needs a 2-D lora_A and lora_B weight, got {parts}")
        (rank, in_features), (out_features, rank_b) = parts["A"], parts["B"]
        if rank != rank_b:
            raise self.error(f"module {module!r}: lora_A has rank {rank}, lora_B rank {rank_b}")
        if rank > max_rank:
            raise self.error(f"module {module!r} has rank {rank}, above max_lora_rank={max_rank}; "
                             f"raise max_lora_rank to at least {rank}")
        want = shapes[module]
        if (in_features, out_features) != want:
            raise self.error(f"module {module!r} maps {in_features} -> {out_features} features, the "
                             f"model's {want[0]} -> {want[1]}: an adapter for another base model")
        return rank

    def load(self) -> dict[str, ModuleDelta]:
        """The weights, as float32 ``ModuleDelta`` per module (read from the file now)."""
        tensors = load_file(str(self.path / WEIGHTS_FILE))
        deltas: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, part = self._split_key(key)
            deltas.setdefault(module, {})[part] = tensor.float().contiguous()
        return {m: ModuleDelta(d["A"], d["B"], self.scales[m]) for m, d in deltas.items() if m in self.ranks}
