"""LoRA adapters: many PEFT adapters over one base model, in one batch.

``LoRARequest`` (vLLM's name) is torch-free and importable from here or from
``batchgen.lora.request``; the engine side is :mod:`batchgen.lora.adapter` (reading and checking
a PEFT folder), :mod:`batchgen.lora.layers` (the batched delta on each targeted projection) and
:mod:`batchgen.lora.manager` (the loaded adapters and the step's rows). See ``docs/lora.md``.
"""

from batchgen.lora.request import LoRARequest

__all__ = ["LoRARequest"]
