"""The instrument behind docs/kernels.md's bfloat16-attention figures
(``bench.bf16_attention_accuracy``): its float32 form is ordinary causal attention (torch's SDPA),
and its bfloat16 forms differ from it only by rounding their operands."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.bf16_attention_accuracy import attention


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, 40, 64, generator=gen)  # 6 query heads over 2 KV heads, 40 tokens
    k = torch.randn(1, 2, 40, 64, generator=gen)
    v = torch.randn(1, 2, 40, 64, generator=gen)
    return q, k, v


def test_the_float32_form_is_causal_attention() -> None:
    q, k, v = _inputs()
    out, _ = attention(None, q, k, v, None, 0.125, form="float32")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert out.shape == (1, 40, 6, 64)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_the_bfloat16_forms_only_round_their_operands() -> None:
    q, k, v = _inputs(1)
    exact = attention(None, q, k, v, None, 0.125, form="float32")[0]
    for form in ("bf16", "bf16_qk", "bf16_pv"):
        out = attention(None, q, k, v, None, 0.125, form=form)[0]
        assert not torch.equal(out, exact), form
        torch.testing.assert_close(out, exact, rtol=0, atol=0.05)
    # operands that bfloat16 holds exactly (q scaled by a power of two): rounding q and k changes nothing
    qb, kb = q.to(torch.bfloat16).float(), k.to(torch.bfloat16).float()
    assert torch.equal(attention(None, qb, kb, v, None, 0.125, form="bf16_qk")[0],
                       attention(None, qb, kb, v, None, 0.125, form="float32")[0])
