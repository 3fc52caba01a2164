"""The batchgen-typical plugin's processors, on synthetic logits.

Requires ``pip install -e plugins/batchgen-typical`` (see docs/plugins.md).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from batchgen.plugins import PluginError, load_registry

try:
    import batchgen_typical  # noqa: F401
except ImportError:  # fail, not skip: CI must exercise the third-party path
    pytest.fail("the plugin package batchgen-typical is not installed; run: pip install -e plugins/batchgen-typical", pytrace=False)


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def logits_of(*probs: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in probs]], dtype=dtype)


def kept(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


# Hand computation for p = [0.4, 0.3, 0.2, 0.1]:
#   H = -(0.4 ln 0.4 + 0.3 ln 0.3 + 0.2 ln 0.2 + 0.1 ln 0.1) = 1.27985
#   surprisal -ln p = [0.91629, 1.20397, 1.60944, 2.30259]
#   |surprisal - H| = [0.36356, 0.07588, 0.32958, 1.02273]
#   typical order: token 1 (p .3), token 2 (p .2), token 0 (p .4), token 3 (p .1)
#   mass before each in that order: 0, 0.3, 0.5, 0.9
@pytest.mark.parametrize(
    ("mass", "min_keep", "expected"),
    [
        (0.2, 1, [1]),  # token 1 alone already reaches 0.2
        (0.5, 1, [1, 2]),  # 0.3 + 0.2 reaches 0.5: the most likely token 0 is dropped
        (0.85, 1, [0, 1, 2]),
        (1.0, 1, [0, 1, 2, 3]),
        (0.2, 3, [0, 1, 2]),  # min_tokens_to_keep wins over the mass
    ],
)
def test_typical_mask_matches_hand_computation(registry, mass: float, min_keep: int, expected: list[int]) -> None:
    proc = registry.build_sampler("typical", {"mass": mass, "min_tokens_to_keep": min_keep})
    out = proc(logits_of(0.4, 0.3, 0.2, 0.1), [[]])
    assert kept(out[0]) == expected


def test_typical_rows_are_independent_and_masked_tokens_stay_masked(registry) -> None:
    proc = registry.build_sampler("typical", {"mass": 0.5})
    logits = torch.cat([logits_of(0.4, 0.3, 0.2, 0.1, 0.0), logits_of(0.25, 0.25, 0.25, 0.25, 0.0)])
    before = logits.clone()
    out = proc(logits, [[1, 2], []])
    # Row 0 as computed above. Row 1 is flat: every deviation is 0, ties keep index order, and
    # the mass before tokens 0, 1, 2 is 0, 0.25, 0.5, so tokens 0 and 1 are kept.
    assert kept(out[0]) == [1, 2] and kept(out[1]) == [0, 1]
    assert torch.equal(out[0, [1, 2]], before[0, [1, 2]])
    assert not torch.isnan(out).any()


def reference_typical(logits: list[float], mass: float) -> list[int]:
    """Locally typical sampling's kept set, straight from the definition, in float64."""
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    deviation = [abs(-math.log(p) - entropy) if p > 0 else math.inf for p in probs]
    keep, before = [], 0.0
    for i in sorted(range(len(probs)), key=lambda i: (deviation[i], i)):
        if before < mass or not keep:
            keep.append(i)
        before += probs[i]
    return sorted(keep)


def test_typical_matches_the_definition_on_random_rows(registry) -> None:
    rng = random.Random(1234)
    rows = [[rng.gauss(0.0, rng.choice([0.5, 2.0, 5.0])) for _ in range(50)] for _ in range(40)]
    for mass in (0.3, 0.9, 0.95):
        proc = registry.build_sampler("typical", {"mass": mass})
        # float64 so that no row sits within rounding of the mass boundary differently from the reference
        out = proc(torch.tensor(rows, dtype=torch.float64), [[] for _ in rows])
        for row, expected in zip(out, (reference_typical(r, mass) for r in rows)):
            assert kept(row) == expected


# Hand computation for eta sampling, epsilon = 0.04, p = [.3, .2, .15, .15, .1, .035, .035, .03]:
#   H = 1.82234, eta = min(0.04, sqrt(0.04) * exp(-H)) = min(0.04, 0.2 * 0.16165) = 0.032329
#   so the two 0.035 tokens survive (plain epsilon sampling at 0.04 would drop them) and 0.03 goes.
def test_eta_mask_matches_hand_computation(registry) -> None:
    proc = registry.build_sampler("eta", {"epsilon": 0.04})
    out = proc(logits_of(0.3, 0.2, 0.15, 0.15, 0.1, 0.035, 0.035, 0.03), [[]])
    assert kept(out[0]) == [0, 1, 2, 3, 4, 5, 6]
    # Low entropy: p = [.97, .01, .01, .01], H = 0.16770, sqrt(0.02) * exp(-H) = 0.1196 > 0.02,
    # so eta = epsilon = 0.02 and the 0.01 tokens go.
    out = registry.build_sampler("eta", {"epsilon": 0.02})(logits_of(0.97, 0.01, 0.01, 0.01), [[]])
    assert kept(out[0]) == [0]


def test_typical_options_are_validated(registry) -> None:
    with pytest.raises(PluginError) as info:
        registry.build_sampler("typical", {"mass": 1.5, "min_tokens": 2})
    lines = str(info.value).splitlines()
    assert lines[0] == "sampler 'typical' (plugin 'typical' from batchgen-typical 0.1.0): invalid options:"
    assert lines[1] == "  mass: Input should be less than or equal to 1 (got 1.5)"
    assert lines[2] == (
        "  min_tokens: unknown option (did you mean 'min_tokens_to_keep'?). "
        "Allowed options: mass, min_tokens_to_keep."
    )
    with pytest.raises(PluginError, match=r"^unknown sampler plugin 'typcal' \(did you mean 'typical'\?\); installed: "):
        registry.build_sampler("typcal", {})
