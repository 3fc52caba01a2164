"""Which GGUF tensor fills which part of an HF model, and whether a file holds exactly those.

:func:`tensor_names` maps each HF module to its GGUF base name through the ``gguf`` package's
name table of the file's architecture row (:mod:`batchgen.gguf.architectures`);
:func:`expected_tensors` gives each tensor's shape as the model needs it, and
:func:`check_tensors` refuses a file with a tensor missing, of another shape, or with no place in
the model, naming the file and the tensor. The loader fills a model by these names; the metadata
reader checks a file with them before anything is cached.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchgen.gguf.architectures import ARCHITECTURES, Architecture, tensor_name_map
from batchgen.gguf.reader import GGUFError, GGUFFile

__all__ = ["check_tensors", "expected_tensors", "is_tied", "tensor_names"]


def tensor_names(model: torch.nn.Module, row: Architecture, num_layers: int) -> dict[str, str]:
    """HF module name -> GGUF tensor base name (``model.layers.0.self_attn.q_proj`` ->
    ``blk.0.attn_q``), from the ``gguf`` package's own name table of ``row``."""
    table = tensor_name_map(row, num_layers)
    names = {}
    for module_name, _module in model.named_modules():
        if module_name:
            base = table.get_name(module_name)
            if base is None and module_name == "lm_head":
                base = "output"  # the name maps of always-tied architectures (Gemma) lack it
            if base is not None:
                names[module_name] = base
    return names


def is_tied(config: Any, gguf: GGUFFile) -> bool:
    """Whether ``lm_head`` is the token embedding (the file has no ``output.weight``)."""
    return bool(getattr(config, "tie_word_embeddings", False)) and "output.weight" not in gguf.tensors


def expected_tensors(model: torch.nn.Module, gguf: GGUFFile, config: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the shape (HF order) the model needs of it."""
    row = ARCHITECTURES[gguf.architecture]
    expected: dict[str, tuple[int, ...]] = {}
    for module_name, base in tensor_names(model, row, config.num_hidden_layers).items():
        module = model.get_submodule(module_name)
        if module_name.endswith("lm_head") and is_tied(config, gguf):
            continue  # the embedding's tensor
        for param_name, param in module.named_parameters(recurse=False):
            expected[f"{base}.{param_name}"] = tuple(param.shape)
    return expected


def check_tensors(gguf: GGUFFile, config: Any, model: torch.nn.Module | None = None) -> None:
    """Check the file's tensors against the HF model its row and ``config`` build (made on the
    meta device when ``model`` is None: no weights are allocated).

    Raises:
        GGUFError: naming the file and the first tensor the model needs that the file lacks,
            that has another shape, or that the model has no place for.
    """
    from transformers import AutoModelForCausalLM  # heavy; the loader's callers have it imported

    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    row = ARCHITECTURES[gguf.architecture]
    expected = expected_tensors(model, gguf, config)
    for name, shape in expected.items():
        tensor = gguf.tensor(name)  # raises naming the tensor when it is missing
        got = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if int(np.prod(got)) != int(np.prod(shape)) or (len(shape) == 2 and got != shape):
            raise GGUFError(f"{gguf.path}: tensor {name!r} has shape {got}, the {row.name!r} model of this "
                            f"file's config expects {shape}")
    for name in gguf.tensors:
        if name not in expected and name not in row.extra_tensors:
            raise GGUFError(f"{gguf.path}: tensor {name!r} has no place in the {row.name!r} model of this "
                            f"file's config (a {row.hf_model_type} model: the file does not match its "
                            "architecture)")
