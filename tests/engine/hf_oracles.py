"""HF ``generate`` run one prompt at a time (no padding): the oracles of the engine tests."""

from __future__ import annotations

import torch


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos_ids: list[int]) -> list[list[int]]:
    """Greedy tokens per prompt; the EOS that ends a sequence is not part of the output."""
    results = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=eos_ids[0])[0, len(p):].tolist()
            if out and out[-1] in eos_ids:
                out = out[:-1]
            results.append(out)
    return results


def hf_beam(model, prompt: list[int], width: int, length_penalty: float, early_stopping: bool | str,
            max_tokens: int, eos_id: int = 2) -> tuple[list[list[int]], list[float]]:
    """Beam search for one prompt: the ``width`` returned sequences (generated part; one that
    ended by EOS keeps exactly one EOS) and their ``sequences_scores``."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
            length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=max_tokens,
            output_scores=True, return_dict_in_generate=True, pad_token_id=eos_id)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        # Finished beams are padded with the pad id, which is the EOS id here. A row that ends
        # in it ended by EOS (a length-ended beam cannot end in EOS): keep exactly one.
        if row and row[-1] == eos_id:
            while row and row[-1] == eos_id:
                row.pop()
            row.append(eos_id)
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()
