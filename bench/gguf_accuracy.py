"""What the ``gguf`` mode costs in accuracy against float32 on the same file:
``python -m bench.gguf_accuracy --out bench/results/gguf_accuracy.json``.

SmolLM2-135M-Instruct as shipped (a Q4_1 GGUF), loaded twice by batchgen:

* the reference: ``quantization: none``, the blocks de-quantized to float32 at load (bit-equal
  to ``gguf``'s de-quantizer), the float32 C GEMM;
* ``quantization: gguf``, the default on the CPU: the blocks kept, each activation row rounded
  to int8 blocks and multiplied by the int8 kernel (``quant.c``).

Both have the same weights, so every difference is the activations' int8 rounding. Measured:

1. **Log-likelihood of text**: every W32 text (the chat prompts, 32 of them) scored token by
   token, each token given all of the text before it (:func:`text_logprobs`: one prefill per
   text): the per-token gap of the two log-likelihoods (largest, p99, mean), the signed mean
   (the gguf mode's bias, in nats a token) and the perplexity ratio over all the tokens.
2. **Teacher-forced on float32's greedy tokens** (``bench.dtype_accuracy.compare``): the gguf
   mode's top-1 agreement and the logprob gap of float32's token.
3. **llama.cpp's own log-likelihoods on the same file** (where ``llama_cpp`` imports): the
   same per-token gaps against the float32 reference, so the gguf mode's gap is read beside a
   second implementation's (llama.cpp also rounds activations, to Q8 blocks).

The bounds that ``tests/gguf/test_gguf_accuracy.py`` asserts and ``docs/kernels.md`` states come
from these figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.dtype_accuracy import compare, teacher_forced


def text_logprobs(llm: Any, tokens: list[int]) -> torch.Tensor:
    """The log-likelihood (float32) of each token of ``tokens`` after the first, given the
    tokens before it: one prefill on the engine's own runner (:func:`teacher_forced`)."""
    rows = teacher_forced(llm, tokens[:1], tokens[1:])
    return rows[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def gaps(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Per-token gaps of ``other``'s log-likelihoods against ``reference``'s, over all texts."""
    ref, oth = torch.cat(reference).double(), torch.cat(other).double()
    diff = oth - ref
    absd = sorted(diff.abs().tolist())
    return {"tokens": len(absd), "gap_max": absd[-1], "gap_p99": absd[min(len(absd) - 1, int(0.99 * len(absd)))],
            "gap_mean": statistics.fmean(absd), "signed_mean": float(diff.mean()),
            "reference_nll_per_token": float(-ref.mean()), "other_nll_per_token": float(-oth.mean()),
            "perplexity_ratio": math.exp(float(-oth.mean()) - float(-ref.mean()))}


def llama_cpp_logprobs(gguf: str, texts: list[list[int]], threads: int) -> list[torch.Tensor]:
    """llama.cpp's log-likelihood of each token after the first, per text (one ``eval`` per
    text, logits of every position kept)."""
    from llama_cpp import Llama  # the gguf-oracle extra (builds llama.cpp)

    llm = Llama(model_path=gguf, n_ctx=max(len(t) for t in texts) + 8, logits_all=True, n_threads=threads,
                n_batch=512, verbose=False)
    out = []
    for tokens in texts:
        llm.reset()
        llm.eval(tokens)
        logits = torch.tensor(llm.scores[: len(tokens) - 1], dtype=torch.float32)
        lp = torch.log_softmax(logits, dim=-1)
        out.append(lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])])
    return out


def measure(num_prompts: int, max_tokens: int, threads: int, with_llama_cpp: bool) -> dict:
    """The three comparisons of the module docstring (see there)."""
    from batchgen import LLM, SamplingParams
    from batchgen.model_resolver import resolve_model
    from bench.workload import w32_prompts

    texts = w32_prompts()[:num_prompts]
    ref = LLM("smollm2-135m-instruct", quantization="none", dtype="float32", num_threads=threads)
    gguf = LLM("smollm2-135m-instruct", quantization="gguf", num_threads=threads)
    ref_lp = [text_logprobs(ref, t) for t in texts]
    result: dict[str, Any] = {
        "model": "smollm2-135m-instruct (Q4_1 GGUF)", "texts": f"W32, {len(texts)} texts",
        "reference": "quantization none (float32, the de-quantized blocks)", "other": "quantization gguf",
        "text_loglikelihood": gaps(ref_lp, [text_logprobs(gguf, t) for t in texts]),
    }
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    targets = [list(o.outputs[0].token_ids) for o in ref.generate(texts, params)]
    tf = compare(partial(teacher_forced, ref), partial(teacher_forced, gguf), texts, targets)
    result["teacher_forced"] = {k: v for k, v in tf.items() if k != "per_prompt"}
    if with_llama_cpp:
        try:
            file = resolve_model("smollm2-135m-instruct", quantization="gguf").gguf_file
            result["llama_cpp_text_loglikelihood"] = gaps(ref_lp, llama_cpp_logprobs(str(file), texts, threads))
        except ImportError as exc:
            result["llama_cpp_text_loglikelihood"] = f"not run: {exc}"
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = measure(args.num_prompts, args.max_tokens, args.threads, args.llama_cpp)
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    t, tf = result["text_loglikelihood"], result["teacher_forced"]
    print(f"gguf vs float32 on {t['tokens']} text tokens: gap max {t['gap_max']:.4f}, p99 {t['gap_p99']:.4f}, "
          f"mean {t['gap_mean']:.4f} nats, signed mean {t['signed_mean']:+.5f}, perplexity x{t['perplexity_ratio']:.5f}; "
          f"teacher-forced top-1 agreement {tf['top1_agreement']:.4f}, gap max {tf['logprob_gap_max']:.4f}")
    cpp = result.get("llama_cpp_text_loglikelihood")
    if isinstance(cpp, dict):
        print(f"llama.cpp vs float32: gap max {cpp['gap_max']:.4f}, p99 {cpp['gap_p99']:.4f}, mean {cpp['gap_mean']:.4f}, "
              f"perplexity x{cpp['perplexity_ratio']:.5f}")


if __name__ == "__main__":
    main()
