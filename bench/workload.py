"""Workloads of the benchmark: W32 (as given) and W256 (W32 varied eightfold).

W32 is ``bench/w32.jsonl``: 32 chat prompts (SmolLM2's chat template already applied) with
their token ids. The ids are used exactly as given, by every peer.

W256 keeps the 32 prompts and adds seven variants of each, made by putting a short, distinct
opening phrase at the start of the user turn. The shared system prompt stays shared (as in
W32) while the rest of each prompt differs, so no peer can answer a variant from a cached copy
of another prompt's tail. The variants are tokenised with the model's own tokenizer; variant 0
is W32 itself (checked against the given ids).
"""

from __future__ import annotations

import json
from pathlib import Path

W32_PATH = Path(__file__).resolve().parent / "w32.jsonl"
USER_TURN = "<|im_start|>user\n"
VARIANT_OPENINGS = ["", "Quick question. ", "Hi there! ", "Thanks in advance. ", "I am curious. ",
                    "Hello. ", "One more thing. ", "Good morning. "]


def load_w32(path: Path = W32_PATH) -> list[dict]:
    """The W32 records (``index``, ``text``, ``prompt_token_ids``), in file order.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: a record without ``prompt_token_ids``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"workload file {path} is missing; copy w32.jsonl into bench/")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, r in enumerate(records):
        if not isinstance(r.get("prompt_token_ids"), list) or not r["prompt_token_ids"]:
            raise ValueError(f"{path}: record {i} has no prompt_token_ids")
    return records


def w32_prompts() -> list[list[int]]:
    """W32's token ids, exactly as given."""
    return [r["prompt_token_ids"] for r in load_w32()]


def w256_prompts(tokenizer) -> list[list[int]]:
    """256 prompts: the 32 of W32, then 7 variants of each (see the module docstring).

    Raises:
        ValueError: the tokenizer does not reproduce W32's ids on the unvaried text, or a
            prompt lacks the user turn the variants are inserted into.
    """
    records = load_w32()
    prompts: list[list[int]] = []
    for opening in VARIANT_OPENINGS:
        for r in records:
            text = r["text"]
            if USER_TURN not in text:
                raise ValueError(f"W32 record {r['index']}: no {USER_TURN!r} to vary")
            ids = tokenizer(text.replace(USER_TURN, USER_TURN + opening, 1), add_special_tokens=False)["input_ids"]
            if not opening and ids != r["prompt_token_ids"]:
                raise ValueError(f"W32 record {r['index']}: the tokenizer does not reproduce the given ids")
            prompts.append(list(ids))
    return prompts
