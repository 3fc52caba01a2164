"""vLLM (CPU build) as the scoring part's peer: lm-eval's ``vllm`` model's scoring, run by the
vLLM venv's own interpreter (``bench/scoring.py`` starts it; standard library and vLLM only,
as ``bench/peers/vllm_worker.py``).

``python vllm_scoring.py MODEL_DIR WORKLOAD.json OPTIONS.json``. The workload holds lm-eval
``vllm`` inputs already cut (``bench.scoring.vllm_inputs``: the pairs' tokens or the rolling
windows, each ``[input ids, ctxlen]`` as ``VLLM._loglikelihood_tokens`` builds them, since
lm-eval is not installed in that venv). They run as ``VLLM`` runs them with ``batch_size
auto``: every input in one ``LLM.generate`` with ``SamplingParams(temperature=0,
prompt_logprobs=1, max_tokens=1, detokenize=False)``; each result is ``_parse_logprobs``'s sum
of the prompt logprobs from ``ctxlen`` on and whether each was the top token.

Engine: ``vllm.LLM(model, dtype, seed=0, max_model_len, enable_prefix_caching=True,
block_size)`` (options; the CPU build refuses block size 16), the KV space and thread binding
from the environment (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A two-input warm-up, then the prefix cache is reset and
the timed call runs. Prints one ``@@RESULT <json>`` line: ``seconds``, ``loglikelihoods``,
``greedy``, ``prefill_tokens`` (inputs' tokens not found in the prefix cache), peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def parse(output, tokens: list[int], ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``VLLM._parse_logprobs``: the sum of the continuation's prompt logprobs and
    whether each continuation token was the most likely one."""
    entries = output.prompt_logprobs
    total, greedy = 0.0, True
    for token, entry in zip(tokens[ctxlen:], entries[ctxlen:]):
        values = {t: getattr(lp, "logprob", lp) for t, lp in entry.items()}
        total += values[token]
        greedy = greedy and token == max(values, key=values.get)
    return total, greedy


def main() -> None:
    model, workload, options = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams, TokensPrompt

    inputs = json.loads(workload.read_text())["inputs"]
    llm = LLM(model=model, dtype=options.get("dtype", "float32"), seed=0,
              max_model_len=options["max_model_len"], enable_prefix_caching=True,
              block_size=options.get("block_size", 32))
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1024))) for _ in range(2)], params,
                 use_tqdm=False)
    llm.reset_prefix_cache()
    prompts = [TokensPrompt(prompt_token_ids=tokens) for tokens, _ in inputs]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    results = [parse(o, tokens, ctxlen) for o, (tokens, ctxlen) in zip(outputs, inputs)]
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    out = {"seconds": seconds, "loglikelihoods": [r[0] for r in results], "greedy": [r[1] for r in results],
           "prefill_tokens": sum(len(t) for t, _ in inputs) - cached,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print("@@RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
