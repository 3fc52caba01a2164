"""HF transformers ``generate`` with a static, left-padded batch (the usual dense-cache way).

Setup: ``AutoModelForCausalLM.from_pretrained(<batchgen's SmolLM2 folder>, dtype=float32 (or as given))``,
SDPA attention, ``DynamicCache``. The whole workload is one batch (or chunks of
``batch_size``), left-padded with the pad token; every row runs until the whole batch is
done, which is exactly the cost a static batch pays. Sampling uses ``top_k=0`` so that only
temperature and top-p act, as in batchgen and vLLM. Beam search uses ``num_beams=4,
num_return_sequences=4, length_penalty=1.0, early_stopping=False`` (batchgen's defaults,
which follow HF).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.peers import WARMUP_PROMPT, strip_at_eos


def cache_bytes(cache: Any) -> int:
    """Bytes held by the K/V tensors of a transformers cache object (0 if none)."""
    if cache is None:
        return 0
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
    for item in cache:  # legacy tuple-of-tuples
        for t in item:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class HFGenerate:
    """See the module docstring. ``batch_size`` None: the whole workload in one batch."""

    name = "hf_generate"

    def __init__(self, model_path: str, batch_size: int | None = None, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.batch_size = batch_size
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        tok = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0]
        self._generate([WARMUP_PROMPT], {"kind": "greedy"}, 4, 0)

    def setup(self) -> dict:
        return {"peer": self.name, "model_path": self.model_path, "dtype": self.dtype,
                "attn_implementation": self.model.config._attn_implementation,
                "batch": "static, left-padded", "batch_size": self.batch_size or "whole workload",
                "pad_token_id": self.pad_id, "eos_token_ids": self.eos_ids,
                "torch_threads": torch.get_num_threads()}

    def _kwargs(self, mode: dict, max_tokens: int) -> dict:
        kw: dict[str, Any] = dict(max_new_tokens=max_tokens, pad_token_id=self.pad_id,
                                  eos_token_id=self.eos_ids, return_dict_in_generate=True)
        if mode["kind"] == "greedy":
            kw.update(do_sample=False, num_beams=1)
        elif mode["kind"] == "sample":
            kw.update(do_sample=True, temperature=mode["temperature"], top_p=mode["top_p"], top_k=0,
                      num_return_sequences=mode["n"])
        elif mode["kind"] == "beam":
            kw.update(do_sample=False, num_beams=mode["beam_width"],
                      num_return_sequences=mode["beam_width"], length_penalty=1.0,
                      early_stopping=False)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        return kw

    def _generate(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int
                  ) -> tuple[list[list[list[int]]], int, int]:
        """Returns per prompt the list of generated sequences, the peak KV bytes, and the prompt
        tokens computed (each batch's padded width times its rows)."""
        torch.manual_seed(seed)
        kw = self._kwargs(mode, max_tokens)
        size = self.batch_size or len(prompts)
        results: list[list[list[int]]] = []
        kv_peak = prefill = 0
        for start in range(0, len(prompts), size):
            chunk = prompts[start:start + size]
            width = max(len(p) for p in chunk)
            prefill += width * len(chunk)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
            cache = getattr(out, "cache", None)
            if cache is None:
                cache = getattr(out, "past_key_values", None)
            kv_peak = max(kv_peak, cache_bytes(cache))
            seqs = out.sequences[:, width:].tolist()
            per = len(seqs) // len(chunk)
            for i in range(len(chunk)):
                results.append([strip_at_eos(s, self.eos_ids) for s in seqs[i * per:(i + 1) * per]])
        return results, kv_peak, prefill

    def run(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> dict:
        t0 = time.perf_counter()
        outputs, kv, prefill = self._generate(prompts, mode, max_tokens, seed)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": sum(len(s) for o in outputs for s in o),
                "kv_bytes": kv, "kv_bytes_note": "K/V tensors of the final DynamicCache (its peak)",
                "prefill_tokens": prefill, "outputs": outputs}
