"""What bfloat16 costs in accuracy against float32 on W32:
``python -m bench.dtype_accuracy --out bench/results/dtype_accuracy.json``.

SmolLM2-135M-Instruct through batchgen's default CPU path (the C kernels), once in float32 and
once in bfloat16 (weights and KV cache), W32, greedy, max_tokens 64:

1. **Free-running**: both generate greedily with ``logprobs=0``; how many of the 32 outputs are
   identical, where the others first part, and the chosen tokens' logprob gaps while the two
   still agree.
2. **Teacher-forced**: each prompt followed by float32's greedy tokens runs as one prefill
   through each engine, with the logits of every position kept (:func:`teacher_forced`), so
   both models are scored at the same contexts even where bfloat16 would have gone its own
   way. Per position: top-1 agreement (bfloat16's argmax is float32's token), the gap between
   the two logprobs of float32's token, and KL(float32 || bfloat16). float32's own argmax
   there is checked against its greedy tokens (prefill against decode: equal, by the kernels'
   reproducibility). The same comparison on plain ``transformers`` models (torch's ops, float32
   against the same dtype) shows what the dtype costs without batchgen's kernels.

The bounds asserted by ``tests/engine/test_dtype_accuracy.py`` and stated in
``docs/kernels.md`` come from these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from functools import partial
from typing import Any, Callable

import torch


def teacher_forced(llm: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Log-softmax ``[len(continuation), vocab]`` (float32) of ``llm``'s next-token
    distribution before each token of ``continuation``, given ``prompt`` and the tokens of
    ``continuation`` before it: one prefill of the whole text on the engine's own model runner
    (its dtype, its kernels), logits kept at every position.

    The prefill writes its K/V into the cache's first blocks, outside the block manager, and
    then clears the prefix cache, so call it between ``generate`` calls, never during one.

    Raises:
        ValueError: an empty prompt or continuation, or a text longer than the KV cache.
    """
    from batchgen.engine.sequence import Sequence

    if not prompt or not continuation:
        raise ValueError("teacher forcing needs a prompt and at least one continuation token")
    runner = llm.runner
    tokens = list(prompt) + list(continuation)
    num_blocks = -(-len(tokens) // runner.block_size)
    if num_blocks > runner.num_blocks:
        raise ValueError(f"{len(tokens)} tokens need {num_blocks} KV blocks; the cache has {runner.num_blocks}")
    seq = Sequence(tokens)
    seq.block_table = list(range(num_blocks))
    step = runner.prepare([(seq, len(tokens))], [True])
    step.logits_indices = torch.arange(len(prompt) - 1, len(tokens) - 1, device=runner.device)
    with torch.inference_mode():
        logits = runner.model(input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False,
                              logits_to_keep=step.logits_indices, batchgen_metadata=step.metadata).logits[0]
    if not llm.reset_prefix_cache():
        raise RuntimeError("teacher_forced ran while requests held KV blocks")
    return torch.log_softmax(logits.float(), dim=-1)


def hf_teacher_forced(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """:func:`teacher_forced` for a plain HF ``transformers`` model (one forward, no cache)."""
    ids = torch.tensor([list(prompt) + list(continuation)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


Scorer = Callable[[list[int], list[int]], torch.Tensor]


def compare(reference: Scorer, other: Scorer, prompts: list[list[int]], targets: list[list[int]]) -> dict:
    """Teacher-forced comparison of ``other`` against ``reference`` (each a function
    ``(prompt, continuation) -> log-softmax rows``, as :func:`teacher_forced` with its engine)
    on ``targets`` (the reference's greedy tokens). Per position: agreement of ``other``'s
    argmax with the target, the absolute gap of the target's logprob, KL(reference || other);
    and how often the reference's own argmax is its target."""
    agree = self_agree = positions = 0
    gaps: list[float] = []
    kls: list[float] = []
    per_prompt = []
    for prompt, target in zip(prompts, targets):
        if not target:
            continue
        ref = reference(prompt, target)
        oth = other(prompt, target)
        t = torch.tensor(target)
        rows = torch.arange(len(target))
        ok = oth.argmax(-1) == t
        gap = (oth[rows, t] - ref[rows, t]).abs()
        kl = (ref.exp() * (ref - oth)).sum(-1)
        agree += int(ok.sum())
        self_agree += int((ref.argmax(-1) == t).sum())
        positions += len(target)
        gaps += gap.tolist()
        kls += kl.tolist()
        per_prompt.append({"positions": len(target), "top1_agree": int(ok.sum()),
                           "max_logprob_gap": float(gap.max()), "first_disagreement":
                           int(torch.nonzero(~ok)[0]) if not bool(ok.all()) else None})
    gaps_sorted = sorted(gaps)
    return {
        "positions": positions,
        "top1_agreement": agree / positions,
        "top1_disagreements": positions - agree,
        "reference_self_agreement": self_agree / positions,
        "logprob_gap_max": max(gaps),
        "logprob_gap_mean": statistics.fmean(gaps),
        "logprob_gap_median": statistics.median(gaps),
        "logprob_gap_p99": gaps_sorted[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "kl_mean": statistics.fmean(kls),
        "kl_max": max(kls),
        "per_prompt": per_prompt,
    }


def free_running(ref_outs: list, other_outs: list) -> dict:
    """Identical greedy outputs, where the others first differ, and the chosen tokens' logprob
    gaps over each pair's common prefix."""
    identical = 0
    first_diff: list[int] = []
    gaps: list[float] = []
    for a, b in zip(ref_outs, other_outs):
        x, y = a.outputs[0], b.outputs[0]
        k = 0
        while k < min(len(x.token_ids), len(y.token_ids)) and x.token_ids[k] == y.token_ids[k]:
            k += 1
        if list(x.token_ids) == list(y.token_ids):
            identical += 1
        else:
            first_diff.append(k)
        for i in range(k):
            tok = x.token_ids[i]
            gaps.append(abs(x.logprobs[i][tok] - y.logprobs[i][tok]))
    return {"prompts": len(ref_outs), "identical": identical, "first_difference_at": sorted(first_diff),
            "common_prefix_logprob_gap_max": max(gaps) if gaps else None,
            "common_prefix_logprob_gap_mean": statistics.fmean(gaps) if gaps else None}


def main() -> None:
    from batchgen import LLM, SamplingParams
    from bench.workload import w32_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--no-hf", dest="hf", action="store_false",
                    help="skip the same comparison on plain transformers models")
    args = ap.parse_args()
    prompts = w32_prompts()[: args.num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0)
    t0 = time.perf_counter()
    ref = LLM("smollm2-135m-instruct", dtype="float32")
    other = LLM("smollm2-135m-instruct", dtype=args.dtype)
    ref_outs = ref.generate(prompts, params)
    other_outs = other.generate(prompts, params)
    targets = [list(o.outputs[0].token_ids) for o in ref_outs]
    result = {
        "model": "smollm2-135m-instruct", "workload": f"W32 ({len(prompts)} prompts), greedy",
        "max_tokens": args.max_tokens, "reference": "float32", "dtype": args.dtype,
        "linear_backend": other.runner.linear_backend, "attention_backend": other.runner.attention_backend,
        "free_running": free_running(ref_outs, other_outs),
        "teacher_forced": compare(partial(teacher_forced, ref), partial(teacher_forced, other), prompts, targets),
    }
    if args.hf:
        from transformers import AutoModelForCausalLM

        from batchgen.model_resolver import resolve_model

        path = resolve_model("smollm2-135m-instruct").path
        del ref, other
        hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        result["hf_torch_teacher_forced"] = compare(partial(hf_teacher_forced, hf32), partial(hf_teacher_forced, hf16),
                                                    prompts, targets)
        result["hf_torch_note"] = ("the same comparison on plain transformers models (torch's own float32 and "
                                   f"{args.dtype} ops), on the same float32 greedy tokens: what {args.dtype} costs "
                                   "without batchgen's kernels")
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    fr, tf = result["free_running"], result["teacher_forced"]
    print(f"{args.dtype} vs float32 on W32: {fr['identical']}/{fr['prompts']} greedy outputs identical; "
          f"teacher-forced top-1 agreement {tf['top1_agreement']:.4f} ({tf['top1_disagreements']} of "
          f"{tf['positions']} positions differ), logprob gap max {tf['logprob_gap_max']:.4f}, "
          f"p99 {tf['logprob_gap_p99']:.4f}, mean {tf['logprob_gap_mean']:.4f}; "
          f"float32 self-agreement {tf['reference_self_agreement']:.4f}")
    if "hf_torch_teacher_forced" in result:
        hf = result["hf_torch_teacher_forced"]
        print(f"transformers {args.dtype} vs float32: top-1 agreement {hf['top1_agreement']:.4f}, "
              f"logprob gap max {hf['logprob_gap_max']:.4f}, p99 {hf['logprob_gap_p99']:.4f}, "
              f"mean {hf['logprob_gap_mean']:.4f}; float32 self-agreement {hf['reference_self_agreement']:.4f}")


if __name__ == "__main__":
    main()
