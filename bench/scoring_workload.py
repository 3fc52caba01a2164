"""The ``scoring`` part's workloads, built deterministically from W32's chat prompts
(``bench/w32.jsonl``): lm-eval-style multiple-choice requests (:func:`mc_requests`: one 5-shot
prefix, questions of sentences of W32's user messages, choices of its words) and texts for
rolling perplexity (:func:`ppl_texts`). See :mod:`bench.scoring` for how they are run."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHOTS = 5
CHOICES = 4


def _user_texts() -> list[str]:
    texts = []
    for line in (REPO / "bench" / "w32.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        texts.append(user.strip())
    return texts


def _sentences() -> list[str]:
    out = []
    for text in _user_texts():
        for part in text.replace("?", "?|").replace(".", ".|").split("|"):
            if part.strip():
                out.append(part.strip())
    return out


def mc_requests(tokenizer, questions: int, seed: int = 0) -> dict[str, Any]:
    """``{"pairs": [(context, continuation)...], "answers": [...], "choices": 4}``, question by
    question, choice by choice."""
    rng = random.Random(seed)
    sentences = _sentences()
    words = sorted({w.strip(".,?!") for s in sentences for w in s.split() if w.strip(".,?!")})

    def question() -> str:
        parts: list[str] = []
        while len(tokenizer.encode(" ".join(parts))) < 36:
            parts.append(rng.choice(sentences))
        return " ".join(parts)

    def choice(lo: int = 5, hi: int = 20) -> str:
        target = rng.randint(lo, hi)
        picked: list[str] = []
        while len(tokenizer.encode(" " + " ".join(picked))) < target:
            picked.append(rng.choice(words))
        return " " + " ".join(picked)

    shots = "".join(f"Question: {question()}\nAnswer:{choice(20, 34)}\n\n" for _ in range(SHOTS))
    pairs, answers = [], []
    for _ in range(questions):
        context = shots + f"Question: {question()}\nAnswer:"
        pairs.extend((context, choice()) for _ in range(CHOICES))
        answers.append(rng.randrange(CHOICES))
    return {"pairs": pairs, "answers": answers, "choices": CHOICES,
            "prefix_tokens": len(tokenizer.encode(shots))}


def ppl_texts(tokenizer, tokens: int) -> list[str]:
    """Texts of W32 user messages (in a fixed shuffled order), about 10K tokens each, ``tokens`` in all."""
    rng = random.Random(1)
    base = _user_texts()
    texts, current, total = [], [], 0
    while total < tokens:
        current.append(rng.choice(base))
        if len(tokenizer.encode(" ".join(current))) >= min(10_000, tokens - total):
            texts.append(" ".join(current))
            total += len(tokenizer.encode(texts[-1]))
            current = []
    return texts
