"""Where one rolling-perplexity window's time goes: ``python -m bench.profile_scoring --out FILE``.

One text of ``--tokens`` (2048) W32 tokens through :meth:`batchgen.LLM.loglikelihood_rolling`
with ``max_length`` 2048: one window, one engine step of 2048 positions (the step budget,
``max_num_batched_tokens``, is 2048 by default), every position scored. The engine is watched
from outside (as ``bench.profile_step`` does; no engine code changes), timing:

* ``linear``: the model's linear layers but the lm-head (batchgen's float32 GEMM, or the
  ``gguf`` mode's int8 kernels), with the rate in GFLOP/s (2 x rows x in x out);
* ``attention``: the paged attention ops (the CPU kernel's prefill path over the 2048 context);
* ``lm_head``: the output layer over the 2048 scored positions (chunks of
  ``chunk_rows_for(vocab)`` rows, 64 for SmolLM2's 49,152);
* ``reduction``: :func:`batchgen.sampling.logprobs.reduce_logprobs` without the lm-head inside
  it (log-softmax, gather, rank, the lists);
* ``model_other``: the forward but attention and linear layers (norms, RoPE, activations);
* ``engine_other``: the call but the forward and the reduction (scheduling, packing, Python).

``--quantization none`` (the float32 folder) or ``gguf`` (the Q4_1 file's blocks); ``--dtype``;
``--torch-reduction`` forces the reduction's torch path (what every run took before the fused
logsumexp/rank pass). Each of ``--repeats`` calls is timed; the JSON keeps every call's parts and
the fastest call's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from bench.profile_step import TimedOps, _is_linear, linear_weights, time_linears, wrap
from bench.scoring_workload import ppl_texts

ATTN_FLOP_NOTE = "attention GFLOP/s: causal QK and PV, 4 x heads x head_size x n(n+1)/2 per layer"


def _time_head(head: torch.nn.Module, clock: dict[str, float]) -> None:
    inner: Callable = head.forward

    def timed(x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(x)
        clock["lm_head"] += time.perf_counter() - t0
        return out
    head.forward = timed


def _force_torch_reduction(runner_module: Any) -> None:
    inner = runner_module.reduce_logprobs

    def torch_path(*args: Any, **kwargs: Any) -> Any:
        kwargs["fused"] = False
        return inner(*args, **kwargs)
    runner_module.reduce_logprobs = torch_path


def _parts(clock: dict[str, float], total: float, head_is_linear: bool) -> dict[str, float]:
    linear = clock["linear"] - (clock["lm_head"] if head_is_linear else 0.0)  # the head's time, once
    parts = {"linear": linear, "attention": clock["attention"], "lm_head": clock["lm_head"],
             "reduction": clock["reduce"] - clock["lm_head"],
             "model_other": clock["forward"] - clock["attention"] - linear}
    parts["engine_other"] = total - clock["forward"] - clock["reduce"]
    parts["total"] = total
    return parts


def _rates(llm: Any, parts: dict[str, float], n: int) -> dict[str, float]:
    cfg = llm.runner.config
    model = llm.runner.model
    head = model.get_output_embeddings()
    weights = linear_weights(model) - (head.in_features * head.out_features if _is_linear(head) else 0)
    heads, size = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    attn = cfg.num_hidden_layers * 4 * heads * size * n * (n + 1) / 2
    return {"linear_gflops": 2 * n * weights / parts["linear"] / 1e9,
            "lm_head_gflops": 2 * n * head.in_features * head.out_features / parts["lm_head"] / 1e9,
            "attention_gflops": attn / parts["attention"] / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none", choices=["none", "gguf"])
    ap.add_argument("--torch-reduction", action="store_true", help="the reduction's torch path (the old one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from batchgen import LLM
    from batchgen.engine import model_runner

    if args.torch_reduction:
        _force_torch_reduction(model_runner)
    llm = LLM("smollm2-135m-instruct", quantization=args.quantization, dtype=args.dtype,
              num_threads=args.threads, kv_cache_memory=512 << 20)
    tokens = llm.tokenizer.encode(" ".join(ppl_texts(llm.tokenizer, args.tokens + 200)))[:args.tokens]
    llm.loglikelihood_rolling([tokens[:64]], max_length=2048)  # warm-up: kernels built, pools up
    clock: dict[str, float] = defaultdict(float)
    llm.runner.ops = TimedOps(llm.runner.ops, clock)
    time_linears(llm.runner.model, clock)
    _time_head(llm.runner.model.get_output_embeddings(), clock)
    wrap(llm.runner, "_forward", clock, "forward")
    wrap(model_runner, "reduce_logprobs", clock, "reduce")
    calls = []
    for _ in range(args.repeats):
        clock.clear()
        t0 = time.perf_counter()
        total_lp = llm.loglikelihood_rolling([tokens], max_length=2048)[0]
        calls.append(_parts(clock, time.perf_counter() - t0, _is_linear(llm.runner.model.get_output_embeddings())))
    best = min(calls, key=lambda c: c["total"])
    result = {"model": "smollm2-135m-instruct", "quantization": args.quantization, "dtype": args.dtype,
              "threads": args.threads, "tokens": len(tokens), "torch_reduction": args.torch_reduction,
              "max_num_batched_tokens": llm.config.max_num_batched_tokens,
              "linear_backend": llm.runner.linear_backend, "attention_backend": llm.runner.attention_backend,
              "loglikelihood": total_lp, "tokens_per_s": len(tokens) / best["total"], "fastest_seconds": best,
              "fastest_share": {k: v / best["total"] for k, v in best.items() if k != "total"},
              "rates": _rates(llm, best, len(tokens)), "calls": calls, "notes": ATTN_FLOP_NOTE}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(tokens)} tokens in {best['total']:.2f} s ({result['tokens_per_s']:.0f} tok/s): " +
          ", ".join(f"{k} {v:.3f}" for k, v in best.items() if k != "total") +
          "; " + ", ".join(f"{k} {v:.0f}" for k, v in result["rates"].items()))


if __name__ == "__main__":
    main()
