"""The roofline bench's arithmetic (``bench.roof_math``, ``bench.roofline``,
``bench.roof_scoring``): weight bytes and operations per step read from a GGUF file, the
fraction of the roof (a rolling-perplexity window's with attention), and which of issue 35's
targets a row has. No timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import roof_math, roof_report, roofline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gguf"))
from tiny_gguf import write_llama_gguf  # noqa: E402  (tests/gguf is no package)

DIMS = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=320)


def shapes() -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Every layer's (out, in) linear shapes, and the lm_head's, from the model's dimensions."""
    h, i = DIMS["hidden"], DIMS["intermediate"]
    kv = DIMS["kv_heads"] * h // DIMS["heads"]
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    return layer * DIMS["layers"], (DIMS["vocab"], h)


@pytest.mark.parametrize("qtype, block, size", [("Q8_0", 32, 34), ("Q4_0", 32, 18), ("Q4_K", 256, 144)])
def test_bytes_and_ops_per_step_of_a_tied_model(tmp_path: Path, qtype: str, block: int, size: int) -> None:
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, linear_type=qtype, embed_type=qtype, oracle=False, **DIMS)
    weights = roof_math.gguf_weights(path)
    body, (vocab, hidden) = shapes()
    values = sum(n * k for n, k in body) + vocab * hidden
    assert [w.name for w in weights if w.lm_head] == ["token_embd.weight"]  # the tied embedding, once
    assert len(weights) == len(body) + 1
    assert roof_math.step_bytes(weights) == values // block * size
    assert roof_math.step_bytes(roof_math.as_float32(weights)) == 4 * values
    assert roof_math.step_ops(weights, 8) == 2 * 8 * values
    # a prefill of 512 tokens: every token through the layers, one through the lm_head
    assert roof_math.step_ops(weights, 512, 1) == 2 * 512 * sum(n * k for n, k in body) + 2 * vocab * hidden


def test_an_untied_lm_head_is_the_output_weight(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, linear_type="Q8_0", embed_type="Q8_0", output_type="Q6_K", oracle=False, **DIMS)
    weights = roof_math.gguf_weights(path)
    body, (vocab, hidden) = shapes()
    assert [w.name for w in weights if w.lm_head] == ["output.weight"]
    assert "token_embd.weight" not in {w.name for w in weights}  # a lookup reads one row, not the table
    assert roof_math.step_bytes(weights) == sum(n * k for n, k in body) // 32 * 34 + vocab * hidden // 256 * 210


@pytest.mark.parametrize("max_model_len, prompts", [(8192, 1), (513, 1), (512, 2), (200, 4)])
def test_a_prefill_step_is_split_into_prompts_the_context_holds(max_model_len: int, prompts: int) -> None:
    n = roofline.prefill_prompts(512, max_model_len)
    assert n == prompts
    assert 512 % n == 0 and 512 // n + 1 <= max_model_len


def test_tensor_bytes_refuses_a_partial_block() -> None:
    with pytest.raises(ValueError, match="whole blocks of 256"):
        roof_math.tensor_bytes("Q4_K", 8, 300)


def test_under_the_bandwidth_line_the_roof_fraction_is_the_bandwidth_fraction() -> None:
    # 2 ops a byte at 20 GB/s: the roof is 40 GOP/s, far under a 1000 GOP/s ceiling
    r = roof_math.roof_fields(ops=2 * 10**9, nbytes=10**9, seconds=0.1, bandwidth_gbs=20.0, ceiling_gops=1000.0)
    assert r["bound"] == "bandwidth"
    assert r["weight_gbs"] == pytest.approx(10.0) and r["gops"] == pytest.approx(20.0)
    assert r["roof_gops"] == pytest.approx(40.0)
    assert r["of_roof"] == pytest.approx(r["of_bandwidth"]) == pytest.approx(0.5)
    assert r["of_ceiling"] == pytest.approx(0.02)


def test_under_the_ceiling_the_roof_fraction_is_the_ceiling_fraction() -> None:
    # 1000 ops a byte: bandwidth would allow 20,000 GOP/s, so the 1000 GOP/s ceiling binds
    r = roof_math.roof_fields(ops=10**12, nbytes=10**9, seconds=2.0, bandwidth_gbs=20.0, ceiling_gops=1000.0)
    assert r["bound"] == "ceiling"
    assert r["roof_gops"] == pytest.approx(1000.0)
    assert r["of_roof"] == pytest.approx(r["of_ceiling"]) == pytest.approx(0.5)
    assert r["of_bandwidth"] == pytest.approx(0.025)


@pytest.mark.parametrize("row, target", [
    ({"kind": "decode b1", "batch": 1, "ceiling": "int8"}, "of_bandwidth"),
    ({"kind": "decode b8", "batch": 8, "ceiling": "int8"}, None),
    ({"kind": "decode b64", "batch": 64, "ceiling": "int8"}, "of_ceiling"),
    ({"kind": "prefill 512", "batch": 1, "ceiling": "int8"}, "of_ceiling"),
    ({"kind": "decode W32 (b32)", "batch": 32, "ceiling": "int8"}, "of_ceiling"),
    ({"kind": "decode W32 (b32)", "batch": 32, "ceiling": "fp32"}, None),
    ({"kind": "prefill 512", "batch": 2, "ceiling": "int8"}, "of_ceiling"),
])
def test_issue_targets_by_row(row: dict, target: str | None) -> None:
    got = roof_report.target_of(row)
    assert (got[0] if got else None) == target


def test_a_rolling_window_s_roof_adds_attention_at_the_float32_ceiling() -> None:
    from types import SimpleNamespace

    from bench import roof_scoring

    # SmolLM2's shape: 30 layers, 9 heads of 64; a 2,048-token window
    config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, hidden_size=576, head_dim=None)
    attn = roof_math.attention_flops(config, roof_math.causal_keys(2048))
    assert attn == 4 * 30 * 9 * 64 * 2048 * 2049 // 2
    roof = {"bandwidth_gbs": 30.0, "int8_gops": 900.0, "fp32_gops": 230.0}
    # 450 GOP of int8 work (0.5 s at the ceiling) and 115 GFLOP of attention (0.5 s): 1 s at best
    r = roof_scoring.window_fields(ops=450 * 10**9, attn=115 * 10**9, nbytes=10**8, seconds=2.0, roof=roof,
                                   ceiling="int8")
    assert r["bound_s"] == pytest.approx(1.0) and r["of_roof"] == pytest.approx(0.5)
    assert r["gops"] == pytest.approx(225.0) and r["of_ceiling"] == pytest.approx(0.25)  # the linear layers'
    assert r["bound"] == "int8 + attention"
    assert roof_report.target_of({"kind": "rolling ppl 2048", "batch": 1, "ceiling": "int8"}) is None


def test_the_whole_step_s_roof_adds_attention_s_reads_or_work_to_the_linear_layers() -> None:
    roof = {"bandwidth_gbs": 20.0, "int8_gops": 1000.0, "fp32_gops": 200.0}
    # decode: 100 GOP under the ceiling (0.1 s) but 4 GB of weights (0.2 s); 2 GB of K/V (0.1 s)
    # outweigh 1 GFLOP of attention (0.005 s): 0.3 s at best, 0.6 s measured
    r = roof_math.step_roof_fields(ops=10**11, nbytes=4 * 10**9, kv_bytes=2 * 10**9, attn_flops=10**9,
                                   seconds=0.6, roof=roof, ceiling="int8")
    assert r["attention_bound_s"] == pytest.approx(0.1) and r["step_bound_s"] == pytest.approx(0.3)
    assert r["of_step_roof"] == pytest.approx(0.5)
    # prefill: 400 GOP (0.4 s at the ceiling, its 1 GB of weights 0.05 s); 40 GFLOP of attention
    # at the float32 ceiling (0.2 s) outweigh its 0.2 GB of K/V (0.01 s)
    r = roof_math.step_roof_fields(ops=4 * 10**11, nbytes=10**9, kv_bytes=2 * 10**8, attn_flops=4 * 10**10,
                                   seconds=1.2, roof=roof, ceiling="int8")
    assert r["attention_bound_s"] == pytest.approx(0.2) and r["of_step_roof"] == pytest.approx(0.5)
