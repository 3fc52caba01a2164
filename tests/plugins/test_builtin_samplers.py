"""The built-in samplers' masks on synthetic logits, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.plugins import load_registry


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def logits_of(*probs: float) -> torch.Tensor:
    """One row of float32 logits whose softmax is ``probs``."""
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in probs]], dtype=torch.float32)


def kept(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_epsilon_masks_tokens_below_epsilon(registry) -> None:
    proc = registry.build_sampler("epsilon", {"epsilon": 0.05})
    logits = torch.cat([logits_of(0.5, 0.3, 0.16, 0.04), logits_of(0.25, 0.25, 0.25, 0.25)])
    before = logits.clone()
    out = proc(logits, [[], []])
    assert kept(out[0]) == [0, 1, 2] and kept(out[1]) == [0, 1, 2, 3]
    # Kept logits are untouched (masking only), and the processor works in place.
    assert torch.equal(out[0, :3], before[0, :3]) and out.data_ptr() == logits.data_ptr()


def test_epsilon_always_keeps_the_most_likely_token(registry) -> None:
    proc = registry.build_sampler("epsilon", {"epsilon": 0.9})
    out = proc(logits_of(0.2, 0.5, 0.3), [[]])
    assert kept(out[0]) == [1]


def test_top_a_threshold_is_a_times_pmax_squared(registry) -> None:
    proc = registry.build_sampler("top_a", {"a": 0.2})
    # p_max = 0.6, threshold = 0.2 * 0.36 = 0.072: 0.08 survives, 0.02 does not.
    out = proc(logits_of(0.6, 0.3, 0.08, 0.02), [[]])
    assert kept(out[0]) == [0, 1, 2]
    # A flat row: p_max = 0.25, threshold 0.0125, nothing is removed.
    out = proc(logits_of(0.25, 0.25, 0.25, 0.25), [[]])
    assert kept(out[0]) == [0, 1, 2, 3]


def test_already_masked_and_empty_rows_stay_sane(registry) -> None:
    proc = registry.build_sampler("epsilon", {"epsilon": 0.1})
    logits = torch.cat([logits_of(0.7, 0.3, 0.0), torch.full((1, 3), -math.inf)])
    out = proc(logits, [[5], [6]])
    assert kept(out[0]) == [0, 1]
    assert torch.isneginf(out[1]).all() and not torch.isnan(out).any()
