"""The agreement figures of docs/gguf.md, computed one way for every pair of implementations.

- **greedy agreement**: per prompt, the share of the ``n`` greedy tokens before the two
  implementations first differ (1.0: the same continuation); the figure is the mean over the
  prompts;
- **teacher-forced top-1 agreement**: both score the same token sequence (a prompt and the
  reference's greedy continuation); the share of continuation positions whose top-1 token is
  the same;
- **largest logprob gap**: over those positions, the largest difference of the log-probability
  both give to the reference's token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: The prompts (chat-templated with the model's own template).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a binary search does, briefly.",
    "List three primary colours.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
    "Give one tip for writing clear emails.",
]


def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    out = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append([int(t) for t in ids])
    return out


def greedy_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    shares = []
    for want, got in zip(reference, other):
        same = 0
        for a, b in zip(want, got):
            if a != b:
                break
            same += 1
        shares.append(same / max(len(want), 1))
    return sum(shares) / len(shares)


def teacher_forced(reference_logprobs: Callable[[list[int]], torch.Tensor],
                   other_logprobs: Callable[[list[int]], torch.Tensor],
                   prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> dict[str, float]:
    """``*_logprobs(ids)`` -> ``[len(ids), vocab]`` log-probabilities of the next token at each
    position. Returns ``top1`` and ``max_logprob_gap`` over the continuation positions."""
    agree = total = 0
    gap = 0.0
    for prompt, cont in zip(prompts, continuations):
        ids = list(prompt) + list(cont)
        want, got = reference_logprobs(ids).float(), other_logprobs(ids).float()
        rows = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predict the continuation
        target = torch.tensor(cont)
        agree += int((want[rows].argmax(-1) == got[rows].argmax(-1)).sum())
        total += len(cont)
        picked_want = want[rows].gather(1, target[:, None])
        picked_got = got[rows].gather(1, target[:, None])
        gap = max(gap, float((picked_want - picked_got).abs().max()))
    return {"top1": agree / total, "max_logprob_gap": gap}


def hf_logprobs(model: torch.nn.Module) -> Callable[[list[int]], torch.Tensor]:
    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return run


def hf_greedy(model: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            done = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                  min_new_tokens=n, pad_token_id=0)
            out.append([int(t) for t in done[0, len(prompt):]])
    return out
