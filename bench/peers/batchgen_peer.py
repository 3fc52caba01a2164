"""batchgen's ``LLM.generate`` on the paged cache, with per-step KV accounting.

Setup: ``LLM("smollm2-135m-instruct" (or a ``.gguf`` path as given), dtype="float32" (or as given),
block_size=16, kv_cache_memory=1 GiB, max_num_seqs=256, max_num_batched_tokens=2048,
quantization=<the engine's default, or as given>)`` (prefix caching on and attention backend
``auto``, the defaults; on this CPU ``auto`` is the C decode kernel). A fresh
``LLM`` is built for every timed run, so no run finds the previous run's prompts in the prefix
cache (the model load is not timed).

Besides timing, every engine step is observed from outside (the bound ``step`` method is
wrapped on the instance; no engine code changes). After each step it records the blocks in
use, the token slots of those blocks that hold a computed token, and the sequences running.
That yields the KV waste of the paged cache (reserved but unfilled slots), the same quantity
for a dense cache preallocated to S_max tokens per sequence, and the peak concurrency.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any

import torch

from bench.peers import WARMUP_PROMPT

S_MAX = 2048


class StepObserver:
    """Wraps ``llm.step``; after each step samples the block manager and the running sequences.

    Per sample: ``used_blocks`` (blocks with a reference, from the block manager),
    ``filled_slots`` (token slots of those blocks that hold a computed token; a block shared by
    several sequences counts once, with its fullest holder), ``logical_tokens`` (computed
    tokens summed over sequences, a shared prefix counted once per holder, which is what a
    dense per-sequence cache stores) and ``num_seqs`` (sequences holding blocks).
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.samples: list[tuple[int, int, int, int]] = []
        self._inner = llm.step
        llm.step = self._step  # instance attribute shadows the method

    def _step(self) -> Any:
        result = self._inner()
        bm = self.llm.block_manager
        bs = bm.block_size
        fill: dict[int, int] = {}
        logical = 0
        num_seqs = 0
        for group in self.llm.scheduler.running:
            for seq in group.seqs:
                table = seq.block_table
                if not table:
                    continue
                num_seqs += 1
                computed = seq.num_computed_tokens
                logical += computed
                for i, block in enumerate(table):
                    n = min(bs, max(0, computed - i * bs))
                    if n > fill.get(block, -1):
                        fill[block] = n
        self.samples.append((bm.num_used_blocks, sum(fill.values()), logical, num_seqs))
        return result

    def summary(self) -> dict:
        """Waste of the paged cache and of a dense S_max cache, averaged over steps and at the
        step with the most blocks in use; peak concurrency."""
        bs = self.llm.block_manager.block_size
        rows = [s for s in self.samples if s[0] > 0]
        if not rows:
            return {}
        paged = [1 - filled / (used * bs) for used, filled, _, _ in rows]
        dense = [1 - logical / (n * S_MAX) for _, _, logical, n in rows if n]
        peak = max(rows, key=lambda s: s[0])
        return {
            "steps_observed": len(rows),
            "paged_waste_mean": statistics.fmean(paged),
            "paged_waste_at_peak": 1 - peak[1] / (peak[0] * bs),
            "dense_smax_waste_mean": statistics.fmean(dense),
            "dense_smax_waste_at_peak": 1 - peak[2] / (peak[3] * S_MAX),
            "peak_used_blocks": peak[0],
            "peak_filled_slots": peak[1],
            "peak_logical_tokens": peak[2],
            "peak_num_seqs_at_peak_blocks": peak[3],
            "max_concurrent_seqs": max(s[3] for s in rows),
            "s_max": S_MAX,
        }


class BatchgenPeer:
    """See the module docstring."""

    name = "batchgen"

    def __init__(self, model: str = "smollm2-135m-instruct", block_size: int = 16,
                 kv_cache_memory: int = 2**30, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 scheduling_policy: str = "prefix", dtype: str = "float32",
                 json_schema: dict | None = None, lengths: list[int] | None = None,
                 quantization: str | None = None) -> None:
        self.kwargs = dict(dtype=dtype, block_size=block_size, kv_cache_memory=kv_cache_memory,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy)
        if quantization is not None:  # None: the engine's default (``auto``)
            self.kwargs["quantization"] = quantization
        self.model = model
        #: With a schema every request is constrained to it (structured outputs), warm-up included.
        self.json_schema = json_schema
        #: With lengths, prompt i generates exactly ``lengths[i]`` tokens (``ignore_eos``): the same
        #: work as another run whose outputs had these lengths.
        self.lengths = lengths
        self.llm: Any = None
        self._fresh()

    @staticmethod
    def preload() -> None:
        """Import what building an engine imports before it reads a model (batchgen's engine,
        transformers' model classes of the Llama family, the tokenizers), so that a worker's
        RSS measured after this and before the model counts libraries, not the model."""
        import transformers.models.llama.modeling_llama  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        import batchgen.engine.llm  # noqa: F401
        import batchgen.engine.model_runner  # noqa: F401
        import batchgen.kernels.cpu.quant  # noqa: F401

    def _fresh(self) -> None:
        from batchgen import LLM, SamplingParams
        from batchgen.gguf.hf_model import release_freed_memory

        self.llm = None
        gc.collect()
        # the old engine's freed weights stay in glibc's heap until trimmed: without this the
        # peak RSS of every run after the first counted both engines (3,053 against 2,252 MiB
        # on the Gemma-2-2B-shaped Q4_K_M file)
        release_freed_memory()
        self.llm = LLM(self.model, **self.kwargs)
        self.llm.generate([WARMUP_PROMPT], self.constrain(SamplingParams(temperature=0.0, max_tokens=4)))
        self._warm_steps = self.llm.stats().num_steps

    def setup(self) -> dict:
        return {"peer": self.name, "model": self.model, **self.kwargs,
                "num_blocks": self.llm.runner.num_blocks,
                "bytes_per_block": self.llm.runner.cache_shape.bytes_per_block,
                "attention_backend": self.llm.runner.attention_backend,
                "linear_backend": self.llm.runner.linear_backend,
                "quantization": self.llm.runner.source.quantization,
                "num_threads": self.llm.runner.num_threads,
                "torch_threads": torch.get_num_threads(),
                "structured_outputs": {"json": self.json_schema} if self.json_schema is not None else None,
                "lengths": self.lengths}

    def constrain(self, params: Any) -> Any:
        """``params`` constrained to the peer's JSON schema (unchanged without one)."""
        if self.json_schema is None:
            return params
        from batchgen import StructuredOutputsParams

        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=self.json_schema))

    @staticmethod
    def params(mode: dict, max_tokens: int, seed: int) -> Any:
        from batchgen import BeamSearchParams, SamplingParams

        if mode["kind"] == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                  ignore_eos=mode.get("ignore_eos", False))
        if mode["kind"] == "sample":
            return SamplingParams(n=mode["n"], temperature=mode["temperature"], top_p=mode["top_p"],
                                  max_tokens=max_tokens, seed=seed if mode.get("request_seed", True) else None)
        if mode["kind"] == "beam":
            return BeamSearchParams(beam_width=mode["beam_width"], max_tokens=max_tokens)
        raise ValueError(f"unknown mode {mode!r}")

    def run(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> dict:
        if self.llm.stats().num_steps != self._warm_steps:  # used beyond the warm-up: start afresh
            self._fresh()
        llm = self.llm
        before = llm.stats()
        observer = StepObserver(llm)
        params = self.constrain(self.params(mode, max_tokens, seed))
        if self.lengths is not None:
            if len(self.lengths) != len(prompts):
                raise ValueError(f"{len(self.lengths)} lengths for {len(prompts)} prompts")
            params = [dataclasses.replace(params, max_tokens=max(1, n), ignore_eos=True) for n in self.lengths]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        after = llm.stats()
        errors = [o.error for o in outs if o.error]
        savings = [1 - o.stats.num_physical_blocks / o.stats.num_logical_blocks
                   for o in outs if o.stats.num_logical_blocks]
        bpb = llm.runner.cache_shape.bytes_per_block
        stats = after.to_dict()
        for key in ("num_prompt_tokens", "num_generated_tokens", "num_prefill_tokens", "num_steps",
                    "physical_blocks", "logical_blocks", "num_cow_copies", "num_preemptions",
                    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_blocks", "num_evictions"):
            stats[key] = getattr(after, key) - getattr(before, key)
        stats["saving"] = (1 - stats["physical_blocks"] / stats["logical_blocks"]
                           if stats["logical_blocks"] else 0.0)
        return {
            "seconds": seconds,
            "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
            "kv_bytes": after.peak_blocks_used * bpb,
            "kv_bytes_note": "peak blocks in use x bytes per block",
            "kv_bytes_allocated": after.kv_cache_bytes,
            "errors": errors[:5], "num_errors": len(errors),
            "saving_per_request_mean": statistics.fmean(savings) if savings else None,
            "saving_aggregate": stats["saving"],
            "engine_stats": stats,
            "observer": observer.summary(),
            "outputs": [[list(c.token_ids) for c in o.outputs] for o in outs],
        }
