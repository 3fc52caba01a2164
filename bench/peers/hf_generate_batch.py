"""HF transformers ``generate_batch``: its own continuous batching over a paged cache.

Setup (read from transformers' ``continuous_batching`` source): the model is loaded with SDPA,
which ``generate_batch`` keeps on CPU (no flash attention there). On CPU it would size the
cache at 60 % of the machine's RAM, so the cache is set explicitly to about the same budget
as batchgen's: ``ContinuousBatchingConfig(page_size=256 (its default), num_blocks=<budget /
bytes of one 256-token page over all layers>, max_batch_tokens=2048, seed=<run seed>)``.
Sampling is turned on by ``GenerationConfig(do_sample=True, temperature, top_p, top_k=0,
num_return_sequences=n)``; n samples are forked children of one request. Beam search is not
supported: ``generate_batch`` ignores ``num_beams`` (it would silently run greedy), so the
mode is reported as unsupported rather than run. A fresh manager is built for every run (so
its prefix sharing cannot carry prompts over from the previous run); the KV figure is the
manager's cache tensor.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.peers import WARMUP_PROMPT, strip_at_eos, UnsupportedMode

PAGE_SIZE = 256


class HFGenerateBatch:
    """See the module docstring."""

    name = "hf_generate_batch"

    def __init__(self, model_path: str, kv_cache_memory: int = 2**30, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()
        cfg = self.model.config
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        page_bytes = (cfg.num_hidden_layers * 2 * PAGE_SIZE * cfg.num_key_value_heads * head_dim
                      * getattr(torch, dtype).itemsize)
        self.num_blocks = max(1, kv_cache_memory // page_bytes)
        self.kv_cache_memory = kv_cache_memory
        self._generate([WARMUP_PROMPT], {"kind": "greedy"}, 4, 0)

    def setup(self) -> dict:
        return {"peer": self.name, "model_path": self.model_path, "dtype": self.dtype, "attn_implementation": "sdpa",
                "page_size": PAGE_SIZE, "num_blocks": self.num_blocks, "max_batch_tokens": 2048,
                "kv_budget_bytes": self.kv_cache_memory, "torch_threads": torch.get_num_threads(),
                "beam": "unsupported (generate_batch ignores num_beams)"}

    def _generate(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int
                  ) -> tuple[list[list[list[int]]], int, list[str]]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        if mode["kind"] == "beam":
            raise UnsupportedMode("generate_batch ignores num_beams: beam search is not supported")
        gen: dict[str, Any] = dict(max_new_tokens=max_tokens, eos_token_id=self.eos_ids,
                                   pad_token_id=self.eos_ids[0])
        if mode["kind"] == "greedy":
            gen.update(do_sample=False)
        elif mode["kind"] == "sample":
            gen.update(do_sample=True, temperature=mode["temperature"], top_p=mode["top_p"], top_k=0,
                       num_return_sequences=mode["n"])
        cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=self.num_blocks,
                                      max_batch_tokens=2048, seed=seed)
        torch.manual_seed(seed)
        results = self.model.generate_batch(prompts, generation_config=GenerationConfig(**gen),
                                            continuous_batching_config=cb, persistent_manager=True,
                                            progress_bar=False)
        manager = getattr(self.model, "_cached_continuous_batching_manager", None)
        kv = 0
        if manager is not None and manager.batch_processor is not None:
            kv = manager.batch_processor.cache.cache_tensor.numel()
        self.model.destroy_cached_continuous_batching_manager()
        n = mode.get("n", 1)
        ordered = list(results.values())
        errors = [r.error for r in ordered if r.error]
        outputs: list[list[list[int]]] = []
        for i in range(len(prompts)):
            outputs.append([strip_at_eos(list(r.generated_tokens), self.eos_ids) for r in ordered[i * n:(i + 1) * n]])
        if len(ordered) != len(prompts) * n:
            errors.append(f"{len(ordered)} results for {len(prompts) * n} expected sequences")
        return outputs, kv, errors

    def run(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> dict:
        t0 = time.perf_counter()
        outputs, kv, errors = self._generate(prompts, mode, max_tokens, seed)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": sum(len(s) for o in outputs for s in o),
                "kv_bytes": kv, "kv_bytes_note": "the manager's whole cache tensor (allocated)",
                "errors": errors[:5], "num_errors": len(errors), "outputs": outputs}
