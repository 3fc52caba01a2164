"""What attention in bfloat16 dot products would cost in accuracy:
``python -m bench.bf16_attention_accuracy --out FILE``.

`vdpbf16ps` runs at about twice the float32 FMA rate on an AVX512-BF16 core
(``bench/quant_peak.c``), so the one faster arithmetic left for the CPU attention kernel is
bfloat16 products with float32 sums. Before any kernel takes it, this measures what it would do
to a scoring run: SmolLM2 (the float32 model, HF ``transformers``) scores the rolling-perplexity
bench text (``bench.scoring_workload.ppl_texts``, windows of 2,048 tokens) with an attention
function registered through HF's ``AttentionInterface`` in four forms:

* ``float32``: the scaled query times the keys, the softmax numerators exp(s - max) over the
  causal keys, numerators times values over their float32 sum (batchgen's order of operations);
* ``bf16``: the same, with the scaled query, the keys, the numerators and the values rounded to
  bfloat16 (round to nearest even) before their products, the sums in float32: what a kernel on
  `vdpbf16ps` would compute, up to the order of its sums;
* ``bf16_qk``: only the query and keys rounded; ``bf16_pv``: only the numerators and values.

It reports each form's per-token log-likelihood gap from ``float32``: the total, the mean of its
absolute value and its largest. No kernel of batchgen runs here: this is arithmetic, in torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.scoring_workload import ppl_texts

FORMS = {"float32": (False, False), "bf16": (True, True), "bf16_qk": (True, False), "bf16_pv": (False, True)}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, form="float32", **kwargs):
    """Causal attention over one window in ``form``'s arithmetic (FORMS: round q, k / e, v)."""
    round_qk, round_pv = FORMS[form]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    q = query * scaling
    if round_qk:
        q, key = _bf16(q), _bf16(key)
    s = q @ key.transpose(-1, -2)
    n = s.shape[-1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    total = e.sum(-1, keepdim=True)
    if round_pv:
        e, value = _bf16(e), _bf16(value)
    return ((e @ value) / total).transpose(1, 2).contiguous(), None


def token_logprobs(model, ids: list[int], window: int) -> torch.Tensor:
    """Each token's log-probability given the tokens before it in its window (disjoint windows)."""
    out = []
    with torch.inference_mode():
        for w in range(0, len(ids), window):
            x = torch.tensor([ids[w:w + window]])
            lp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            out.append(lp.gather(-1, x[0, 1:, None])[:, 0])
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # transformers is the bench's peer, not a dependency of batchgen's core
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from batchgen.model_resolver import resolve_model

    path = resolve_model("smollm2-135m-instruct").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer.encode(" ".join(ppl_texts(tokenizer, args.tokens + 200)))[:args.tokens]
    logprobs = {}
    for form in FORMS:
        AttentionInterface.register(f"bench_{form}", lambda *a, _form=form, **k: attention(*a, form=_form, **k))
        model.config._attn_implementation = f"bench_{form}"
        logprobs[form] = token_logprobs(model, ids, args.window)
        print(f"{form}: total log-likelihood {logprobs[form].sum().item():.3f}", flush=True)
    result = {"model": "smollm2-135m-instruct", "tokens": len(ids), "window": args.window,
              "scored_tokens": int(logprobs["float32"].numel()), "forms": {}}
    for form in FORMS:
        gap = logprobs[form] - logprobs["float32"]
        result["forms"][form] = {"total_loglikelihood": logprobs[form].sum().item(),
                                 "total_gap": gap.sum().item(), "mean_abs_gap": gap.abs().mean().item(),
                                 "max_abs_gap": gap.abs().max().item()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for form, r in result["forms"].items():
        print(f"{form}: gap {r['total_gap']:+.3f} nats over {result['scored_tokens']} tokens, "
              f"mean |gap| {r['mean_abs_gap']:.5f}, largest {r['max_abs_gap']:.4f}")


if __name__ == "__main__":
    main()
