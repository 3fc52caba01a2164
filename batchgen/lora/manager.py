"""LoRAManager: the adapters of one engine, the slots they are loaded in, and each step's rows.

An adapter is *registered* when its first request arrives (:meth:`LoRAManager.register`:
its folder read and checked, no weights), and *loaded* into one of ``max_loras`` slots when a
step first runs one of its rows (:meth:`LoRAManager.begin_step`); when every slot is taken,
the least recently used adapter that the step does not need is evicted. The scheduler admits
no request whose adapter would make more than ``max_loras`` adapters run at once
(``scheduler._lora_fits``), so a step never needs more slots than there are.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from batchgen.lora.adapter import LoRAAdapter, LoRAError
from batchgen.lora.layers import LoRAContext, LoRALinear, wrap_model
from batchgen.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Wraps ``model``'s projections (:func:`~batchgen.lora.layers.wrap_model`) and keeps
    the adapters. Counters: :attr:`num_loads` (adapters loaded into a slot, reloads after an
    eviction included) and :attr:`num_evictions`."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.context = LoRAContext()
        self.layers: dict[str, LoRALinear] = wrap_model(model, self.context, max_loras)
        self.shapes = {part.module: (part.in_features, part.stop - part.start)
                       for layer in self.layers.values() for part in layer.parts}
        self.adapters: dict[int, LoRAAdapter] = {}
        self._requests: dict[int, LoRARequest] = {}
        self._errors: dict[LoRARequest, str] = {}
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0
        self.num_evictions = 0

    def register(self, request: LoRARequest) -> str | None:
        """Check ``request``'s adapter (once per request value); its error, or None."""
        if request in self._errors:
            return self._errors[request]
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_path == request.lora_path:
                return None  # the same adapter, whatever name this request gives it
            return (f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                    f"adapter {known.lora_name!r} ({known.lora_path}); give each adapter its own id")
        try:
            adapter = LoRAAdapter.open(request.lora_name, request.lora_int_id, request.lora_path,
                                       self.shapes, self.max_lora_rank)
        except LoRAError as exc:
            self._errors[request] = str(exc)
            return str(exc)
        self._requests[request.lora_int_id] = request
        self.adapters[request.lora_int_id] = adapter
        return None

    def begin_step(self, scheduled: list[tuple[Any, int]]) -> None:
        """Set the step's rows: each scheduled token's slot, in the runner's packing order
        (``scheduled`` is ``(sequence, new tokens)``; a sequence has ``lora_int_id``, 0 for
        the base model), loading adapters as needed."""
        ids = [seq.lora_int_id for seq, _ in scheduled]
        needed = set(ids) - {0}
        if not needed:
            self.context.set(None, frozenset())
            return
        slots = {0: -1}
        for lora_id in needed:
            slots[lora_id] = self._slot_for(lora_id, needed)
        rows: list[int] = []
        for (_, num_new), lora_id in zip(scheduled, ids):
            rows.extend([slots[lora_id]] * num_new)
        self.context.set(torch.tensor(rows, dtype=torch.int32), frozenset(s for s in slots.values() if s >= 0))

    def _slot_for(self, lora_id: int, needed: set[int]) -> int:
        """The slot of adapter ``lora_id``, loading it (evicting the least recently used
        adapter the step does not need) when it has none."""
        if lora_id in self._slots:
            self._slots.move_to_end(lora_id)
            return self._slots[lora_id]
        if not self._free:
            victim = next((i for i in self._slots if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras={self.max_loras} adapters")
            self._free.append(self._slots.pop(victim))
            self.num_evictions += 1
            logger.debug("LoRA adapter %r evicted", self.adapters[victim].name)
        slot = self._free.pop()
        adapter = self.adapters[lora_id]
        deltas = adapter.load()
        for layer in self.layers.values():
            layer.set_slot(slot, deltas)
        self._slots[lora_id] = slot
        self.num_loads += 1
        logger.info("LoRA adapter %r loaded into slot %d (%d modules)", adapter.name, slot, len(deltas))
        return slot

    @property
    def loaded(self) -> list[int]:
        """The loaded adapters' ids, least recently used first."""
        return list(self._slots)
