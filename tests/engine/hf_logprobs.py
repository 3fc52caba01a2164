"""HF forward passes reduced to token logprobs: the oracles of the scoring tests.

Each helper runs one unpadded HF forward pass over a token list and takes ``log_softmax`` of
its float32 logits, as lm-eval's ``hf`` model does for ``loglikelihood``.
"""

from __future__ import annotations

import torch


def hf_prompt_logprobs(model, token_ids: list[int], num_top: int) -> list[dict]:
    """Per position ``p >= 1``: ``{"logprob", "rank", "top_ids", "top_logprobs"}`` of token
    ``p`` given tokens ``0 .. p-1`` (rank as vLLM counts it: 1 + tokens with a larger logit;
    ``rank_range``: the ranks that logprobs within 1e-5 of these may give)."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(token_ids[1:])
    target_lp = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > target_lp).sum(-1) + 1).tolist()
    # the ranks a computation within 1e-5 of these logprobs may give (near-ties can swap)
    eps = 1e-5
    rank_lo = ((logprobs > target_lp + eps).sum(-1) + 1).tolist()
    rank_hi = ((logprobs > target_lp - eps).sum(-1) + 1).tolist()
    top_lp, top_ids = torch.topk(logprobs, num_top, dim=-1) if num_top else (None, None)
    out = []
    for i in range(len(token_ids) - 1):
        out.append({"logprob": float(target_lp[i, 0]), "rank": int(ranks[i]),
                    "rank_range": [int(rank_lo[i]), int(rank_hi[i])],
                    "top_ids": top_ids[i].tolist() if num_top else [],
                    "top_logprobs": top_lp[i].tolist() if num_top else []})
    return out


def hf_loglikelihood(model, context: list[int], continuation: list[int], exact: bool = False) -> tuple[float, bool]:
    """lm-eval's ``hf`` reduction of one pair: the model reads ``(context + continuation)[:-1]``;
    the continuation's logprobs are gathered from the last ``len(continuation)`` positions;
    greedy when each of them is the argmax.

    ``exact``: the ``log_softmax`` of HF's float32 logits taken in float64. A float32
    ``log_softmax`` is biased by about +6e-6 nats per token on SmolLM2 (measured over 1K
    tokens), which adds up over the thousands of tokens of a rolling window.
    """
    whole = context + continuation
    with torch.inference_mode():
        logits = model(torch.tensor([whole[:-1]])).logits[0, -len(continuation):].float()
    logprobs = torch.log_softmax(logits.double() if exact else logits, dim=-1)
    cont = torch.tensor(continuation)
    total = float(logprobs.gather(1, cont.unsqueeze(1)).double().sum())  # a float32 sum drifts
    greedy = bool((logprobs.argmax(-1) == cont).all())
    return total, greedy


def loglikelihood_tolerance(num_tokens: int) -> float:
    """How far a float32 log-likelihood of ``num_tokens`` continuation tokens may be from HF's:
    1e-4 nats up to 5 tokens, 2e-5 per token beyond (the rule of tests/eval/test_lm_eval.py).
    Two float32 implementations differ in every token's ``log_softmax`` by rounding, and the
    sum grows with the tokens: on SmolLM2 a 20-token choice differs from HF by 1.05e-4 on an AMD
    Zen 5 (its GEMM tiles) where it was below 1e-4 on an Intel Xeon."""
    return max(1e-4, 2e-5 * num_tokens)
