"""The final logit soft-cap in place (engine/soft_cap.py): the same bits as transformers'
three out-of-place passes, applied once (the model's own code no longer caps), for scored
positions too. The whole-model equality with HF is test_architectures_hf's (gemma2)."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM
from batchgen.engine.soft_cap import SoftCappedHead, cap_in_place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_equals_the_models_three_passes(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1000, bias=False).to(dtype)
    x = torch.randn(7, 32).to(dtype) * 8  # logits well past the cap: tanh saturates on some
    cap = 30.0
    with torch.no_grad():
        want = head(x) / cap
        want = torch.tanh(want)
        want = want * cap
        got = SoftCappedHead(head, cap)(x)
    assert got.dtype is dtype and torch.equal(got, want)


def test_a_gemma2_engine_caps_once_in_its_head(tiny_model) -> None:
    llm = LLM(tiny_model("gemma2", head_dim=16, final_logit_softcapping=5.0), dtype="float32",
              kv_cache_memory=2**22, num_threads=1)
    model = llm.runner.model
    head = model.get_output_embeddings()
    assert isinstance(head, SoftCappedHead) and head.cap == 5.0
    assert model.config.final_logit_softcapping is None  # the model's own code caps no more
    assert not cap_in_place(model, model.config)  # once
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        logits = llm.runner.compute_logits(hidden)
    assert float(logits.abs().max()) <= 5.0  # capped ...
    assert torch.equal(logits, head(hidden))  # ... once, by the head
