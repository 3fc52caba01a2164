"""Random PEFT LoRA adapters for the LoRA tests (saved with PEFT's own ``save_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base_path: str, out: Path, r: int, targets: list[str], *, rslora: bool = False,
                 alpha: float | None = None, seed: int = 0, std: float = 0.05) -> str:
    """A PEFT LoRA adapter of rank ``r`` on ``targets`` of the model at ``base_path``, with
    random A and B (PEFT's ``init_lora_weights=False`` leaves B random too), saved to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                        use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(str(out))
    return str(out)


def peft_model(base_path: str, adapter: str | None):
    """HF's model with ``adapter`` applied by PEFT (or the plain model), float32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter).eval() if adapter else base


def edit_config(adapter: str, out: Path, **changes) -> str:
    """A copy of ``adapter`` with ``changes`` in its ``adapter_config.json``."""
    out.mkdir(parents=True)
    for file in Path(adapter).iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)
