"""The arithmetic bound in the machine benchmark's summary: FLOP counts and the bound itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import machine


def test_linear_weights_split_matches_the_config():
    from transformers import AutoConfig

    from batchgen.model_resolver import resolve_model

    c = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    assert machine.linear_weights_split() == (c.num_hidden_layers * per_layer, c.vocab_size * c.hidden_size)


def _row(kind: str, vllm_ok: bool = True) -> dict:
    stats = {"num_prefill_tokens": 100, "num_generated_tokens": 50}
    return {"mode": {"kind": kind}, "dtype": "float32", "best_vllm": "vllm_bs32",
            "peers": {"batchgen": {"runs": [{"engine_stats": stats, "num_sequences": 10, "tokens": 48}],
                                   "summary": {"ok": True, "tokens_per_s_median": 6.0}},
                      "vllm_bs32": {"summary": {"ok": vllm_ok, "tokens_per_s_median": 8.0}}}}


def test_flop_bound_rows(tmp_path: Path):
    rows = {"w/greedy/float32": _row("greedy"), "w/n4/float32": _row("sample"),
            "w/greedy/float32_x": _row("greedy", vllm_ok=False)}
    (tmp_path / "machine.json").write_text(json.dumps({"rows": rows}))
    (bound,) = machine.flop_bound_rows(tmp_path, ceilings={"float32": 2.0}, weights=(1e9, 5e8))
    flops = 2 * 1e9 * (100 + 50 - 10) + 2 * 5e8 * 50          # 330 GFLOP
    assert bound["linear_gflop"] == pytest.approx(flops / 1e9)
    assert bound["bound_tokens_per_s"] == pytest.approx(48 / (flops / 2e9))
    assert bound["target"] == pytest.approx(12.0)
    assert bound["batchgen_of_bound"] == pytest.approx(6.0 / bound["bound_tokens_per_s"])
    assert bound["target_of_bound"] == pytest.approx(12.0 / bound["bound_tokens_per_s"])
