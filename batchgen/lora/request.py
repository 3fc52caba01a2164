"""LoRARequest: which LoRA adapter a prompt runs under (vLLM's ``vllm.lora.request.LoRARequest``).

Torch-free: the YAML pipeline and the OpenAI Batch reader build these before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to apply to one request (vLLM's names).

    Attributes:
        lora_name: the adapter's name (in errors, records and results).
        lora_int_id: a unique id >= 1 per adapter; requests with the same id share its slot
            and, through the prefix cache, its KV blocks.
        lora_path: the adapter's folder (``adapter_config.json`` and
            ``adapter_model.safetensors``, as PEFT's ``save_pretrained`` writes them).

    Raises:
        ValueError: an empty name or path, or an id that is not an integer >= 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1 "
                             f"(0 is the base model), got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's folder) is empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of :attr:`lora_int_id`."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of :attr:`lora_name`."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of :attr:`lora_path`."""
        return self.lora_path


def per_prompt(lora_request: "LoRARequest | list[LoRARequest | None] | None", count: int) -> list["LoRARequest | None"]:
    """``generate``'s ``lora_request``: one for every prompt, or one (or None) per prompt.

    Raises:
        ValueError: a list of another length.
        TypeError: something that is no LoRARequest.
    """
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    requests = list(lora_request)
    if len(requests) != count:
        raise ValueError(f"got {len(requests)} lora_request for {count} prompts; give one, or one per prompt")
    for i, request in enumerate(requests):
        if request is not None and not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request {i} must be a LoRARequest or None, got {type(request).__name__}")
    return requests
