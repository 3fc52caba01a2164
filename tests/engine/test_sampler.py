"""The batched sampler on synthetic logits: distributions, penalties, seeds, greedy, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from batchgen.sampling import Sampler, SamplingParams, SamplingRow
from batchgen.sampling.filters import apply_filters, top_candidates

VOCAB = 24


def _row(params: SamplingParams, *, prompt: list[int] | None = None,
         output: list[int] | None = None, generator: torch.Generator | None = None,
         suppress: list[int] | tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=prompt or [0], output_token_ids=output or [],
                       generator=generator, suppress_token_ids=suppress)


def _synthetic_logits(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 1.5


def _expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float,
                           min_p: float) -> list[float]:
    """The target distribution written out from the definitions, in float64 Python."""
    scaled = [v / temperature for v in logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    keep = set(order)
    if top_k > 0:
        kth = scaled[order[top_k - 1]]
        keep = {t for t in keep if scaled[t] >= kth}

    def softmax_over(tokens: set[int]) -> dict[int, float]:
        m = max(scaled[t] for t in tokens)
        z = sum(math.exp(scaled[t] - m) for t in tokens)
        return {t: math.exp(scaled[t] - m) / z for t in tokens}

    if top_p < 1.0:
        probs = softmax_over(keep)
        mass, kept = 0.0, set()
        for t in sorted(keep, key=lambda t: -probs[t]):
            if mass >= top_p:
                break
            kept.add(t)
            mass += probs[t]
        keep = kept
    if min_p > 0.0:
        probs = softmax_over(keep)
        best = max(probs.values())
        keep = {t for t in keep if probs[t] >= min_p * best}
    probs = softmax_over(keep)
    return [probs.get(t, 0.0) for t in range(len(logits))]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.6, 0.0),
        (1.0, 0, 1.0, 0.15),
        (0.9, 8, 0.8, 0.05),
    ],
)
def test_sampled_distribution_matches_truncated_softmax(temperature: float, top_k: int,
                                                        top_p: float, min_p: float) -> None:
    logits = _synthetic_logits(1)
    expected = _expected_distribution(logits.tolist(), temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = 40_000
    torch.manual_seed(1234)
    out = Sampler()(logits.expand(draws, VOCAB).contiguous(), [_row(params)] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double() / draws
    # Tokens outside the truncated support are never drawn.
    for t, p in enumerate(expected):
        if p == 0.0:
            assert counts[t] == 0.0, f"token {t} is outside the support but was drawn"
    # Total variation distance: its expectation here is about 0.01; 0.025 fails a wrong
    # truncation (every case above moves at least 0.05 of mass) and passes sampling noise.
    tv = 0.5 * sum(abs(c - p) for c, p in zip(counts.tolist(), expected))
    assert tv < 0.025, f"total variation {tv:.4f} from the expected distribution"
    assert sum(1 for p in expected if p > 0) < VOCAB or (top_k, top_p, min_p) == (0, 1.0, 0.0)


def test_seeded_rows_sample_the_same_distribution() -> None:
    """The per-row generator path draws from the same distribution as the batched path."""
    logits = _synthetic_logits(2)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    expected = _expected_distribution(logits.tolist(), 0.8, 0, 0.9, 0.0)
    draws = 8_000
    rows = [_row(params, generator=torch.Generator().manual_seed(10_000 + i)) for i in range(draws)]
    out = Sampler()(logits.expand(draws, VOCAB).contiguous(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double() / draws
    tv = 0.5 * sum(abs(c - p) for c, p in zip(counts.tolist(), expected))
    assert tv < 0.05, f"total variation {tv:.4f}"


def test_penalties_against_hand_computed_values() -> None:
    seen: list[torch.Tensor] = []

    def capture(logits: torch.Tensor, output_ids: list[list[int]]) -> torch.Tensor:
        seen.append(logits.clone())
        return logits

    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, logits_processors=[capture])
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    # token 0: prompt only -> repetition only: 2 / 2 = 1.
    # token 1: output once -> -1 * 2 - 0.5 * 1 - 0.25 = -2.75.
    # token 2: unseen -> 0.5.  token 3: output twice -> 3 / 2 - 0.5 * 2 - 0.25 = 0.25.
    # token 4: unseen -> -0.5.
    out = Sampler()(logits, [_row(params, prompt=[0], output=[1, 3, 3])])
    assert seen[0].tolist() == [[1.0, -2.75, 0.5, 0.25, -0.5]]
    assert out.token_ids == [0]  # greedy over the penalised logits, not the raw ones (3)


def test_temperature_scales_before_processors() -> None:
    seen: list[torch.Tensor] = []

    def capture(logits: torch.Tensor, output_ids: list[list[int]]) -> torch.Tensor:
        seen.append(logits.clone())
        return logits

    params = SamplingParams(temperature=2.0, presence_penalty=1.0, logits_processors=[capture])
    Sampler()(torch.tensor([[4.0, 1.0, -2.0]]), [_row(params, output=[0])])
    assert seen[0].tolist() == [[1.5, 0.5, -1.0]]  # (4 - 1) / 2, 1 / 2, -2 / 2


def test_repetition_penalty_matches_hf_processor() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    prompts = [[1, 2, 3], [7, 7, 40], [0]]
    outputs = [[4, 4, 9], [], [49, 3]]
    captured: list[torch.Tensor] = []

    def capture(x: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
        captured.append(x.clone())
        return x

    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, logits_processors=[capture])
    rows = [_row(params, prompt=p, output=o) for p, o in zip(prompts, outputs)]
    Sampler()(logits, rows)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([p + o])
        hf = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[i:i + 1].clone())
        assert torch.equal(captured[0][i:i + 1], hf)


def test_seed_reproducible_alone_and_inside_a_batch_of_32() -> None:
    logits = _synthetic_logits(4)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    steps = 12

    def run_alone() -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        return [Sampler()(logits[None], [_row(params, generator=gen)]).token_ids[0]
                for _ in range(steps)]

    alone = run_alone()
    assert run_alone() == alone
    assert len(set(alone)) > 1  # a real draw, not a constant

    gen = torch.Generator().manual_seed(1234)
    others = [SamplingParams(temperature=0.5 + 0.05 * j, top_k=j % 7, seed=j) for j in range(32)]
    other_gens = [torch.Generator().manual_seed(j) if j % 2 else None for j in range(32)]
    in_batch = []
    for step in range(steps):
        batch_logits = torch.randn(33, VOCAB, generator=torch.Generator().manual_seed(100 + step))
        batch_logits[17] = logits
        rows = [_row(p, generator=g) for p, g in zip(others, other_gens)]
        rows.insert(17, _row(params, generator=gen))
        in_batch.append(Sampler()(batch_logits, rows).token_ids[17])
    assert in_batch == alone


def test_temperature_zero_and_top_k_one_equal_greedy() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(5))
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: the first index wins
    greedy = torch.argmax(logits, dim=-1).tolist()
    assert greedy[3] == 10
    torch.manual_seed(0)
    t0 = Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 16).token_ids
    k1 = Sampler()(logits, [_row(SamplingParams(temperature=1.7, top_k=1))] * 16).token_ids
    seeded_k1 = Sampler()(logits, [_row(SamplingParams(top_k=1, top_p=0.3),
                                        generator=torch.Generator().manual_seed(i))
                                   for i in range(16)]).token_ids
    assert t0 == greedy and k1 == greedy and seeded_k1 == greedy
    # bf16 logits are computed in float32 and still agree with argmax.
    bf = logits.to(torch.bfloat16)
    assert Sampler()(bf, [_row(SamplingParams(temperature=0.0))] * 16).token_ids == \
        torch.argmax(bf.float(), dim=-1).tolist()


def test_suppressed_tokens_are_never_chosen() -> None:
    logits = _synthetic_logits(6)
    top2 = torch.topk(logits, 2).indices.tolist()
    greedy = Sampler()(logits[None], [_row(SamplingParams(temperature=0.0), suppress=[top2[0]])])
    assert greedy.token_ids == [top2[0 + 1]]
    # Reported logprobs stay the raw model's: suppression changes the choice, not the report.
    assert greedy.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[top2[1]].item())
    torch.manual_seed(0)
    draws = 4000
    out = Sampler()(logits.expand(draws, VOCAB).contiguous(),
                    [_row(SamplingParams(temperature=2.0), suppress=top2)] * draws)
    drawn = set(out.token_ids)
    assert not drawn & set(top2)
    assert len(drawn) > 5


def test_every_token_masked_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] have every token masked to -inf"):
        Sampler()(torch.zeros(2, 4), [_row(SamplingParams()),
                                      _row(SamplingParams(), suppress=[0, 1, 2, 3])])


@pytest.mark.parametrize("bad,what", [(math.nan, "NaN"), (math.inf, r"\+inf")])
@pytest.mark.parametrize("greedy", [True, False])
def test_nan_or_inf_logits_are_a_clear_error(bad: float, what: str, greedy: bool) -> None:
    """Greedy would pick the NaN's neighbour and sampling the last id, silently: refuse."""
    def poison(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        logits[0, 2] = bad
        return logits

    params = SamplingParams(temperature=0.0 if greedy else 1.0, logits_processors=[poison])
    with pytest.raises(ValueError, match=rf"rows \[1\] hold {what} logits"):
        Sampler()(torch.zeros(2, 4), [_row(SamplingParams()), _row(params)])
    raw = torch.zeros(2, 4)
    raw[0, 1] = bad  # from the model itself, e.g. an overflow
    with pytest.raises(ValueError, match=rf"rows \[0\] hold {what} logits"):
        Sampler()(raw, [_row(SamplingParams(temperature=0.0 if greedy else 1.0)), _row(SamplingParams())])


def test_logprobs_and_top_logprobs() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)) * 3
    raw_lp = torch.log_softmax(logits, dim=-1)
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=5)),
        # temperature and penalties do not change the reported (raw) logprobs
        _row(SamplingParams(temperature=0.3, logprobs=0, repetition_penalty=1.5, seed=3),
             prompt=[1, 2], output=[5], generator=torch.Generator().manual_seed(3)),
        _row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, rows)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw_lp[i, tok].item(), abs=1e-5)
    top0 = out.top_logprobs[0]
    assert top0 is not None and len(top0) == 5  # the greedy choice is among the top 5
    best5 = torch.topk(raw_lp[0], 5)
    for t, v in zip(best5.indices.tolist(), best5.values.tolist()):
        assert top0[t] == pytest.approx(v, abs=1e-5)
    assert top0[out.token_ids[0]] == out.logprobs[0]
    assert out.top_logprobs[1] == {out.token_ids[1]: out.logprobs[1]}
    assert out.top_logprobs[2] is None


def test_top_logprobs_include_a_chosen_token_outside_the_top() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, logprobs=2), suppress=[0, 1, 2])])
    assert out.token_ids == [3]
    assert set(out.top_logprobs[0]) == {0, 1, 3}


def test_processors_run_once_per_shared_list_and_can_mask() -> None:
    calls: list[list[list[int]]] = []

    def only_even(logits: torch.Tensor, output_ids: list[list[int]]) -> torch.Tensor:
        calls.append(output_ids)
        masked = logits.clone()
        masked[:, 1::2] = -torch.inf
        return masked

    shared = SamplingParams(temperature=1.0, logits_processors=[only_even])
    rows = [_row(shared, output=[i]) for i in range(4)] + [_row(SamplingParams(temperature=0.0))]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(8))
    logits[:, 1] = 50.0  # odd and overwhelming: only the processor keeps it from being drawn
    torch.manual_seed(0)
    out = Sampler()(logits, rows)
    assert calls == [[[0], [1], [2], [3]]]  # one call for the four rows sharing the list
    assert all(t % 2 == 0 for t in out.token_ids[:4])
    assert out.token_ids[4] == 1


def test_processor_with_wrong_shape_is_rejected() -> None:
    params = SamplingParams(logits_processors=[lambda logits, ids: logits[:, :2]])
    with pytest.raises(ValueError, match=r"must return a tensor of shape \(1, 24\), got \(1, 2\)"):
        Sampler()(torch.zeros(1, VOCAB), [_row(params)])


def test_input_logits_are_not_modified_and_shape_is_checked() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    Sampler()(logits, [_row(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.2),
                            suppress=[0]),
                       _row(SamplingParams(temperature=0.0))])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match=r"logits must have shape \[len\(rows\)=1, vocab\]"):
        Sampler()(logits, [_row(SamplingParams())])


def test_top_candidates_are_log_softmax_top_k() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(10))
    cands = top_candidates(logits, 4)
    lp = torch.log_softmax(logits, dim=-1)
    for i in range(2):
        v, t = torch.topk(lp[i], 4)
        assert cands[i] == list(zip(t.tolist(), v.tolist()))


def test_top_k_one_rows_are_scaled_by_temperature_before_processors() -> None:
    seen: list[torch.Tensor] = []

    def capture(logits: torch.Tensor, output_ids: list[list[int]]) -> torch.Tensor:
        seen.append(logits.clone())
        return logits

    logits = torch.tensor([[2.0, -4.0, 1.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=2.0, top_k=1,
                                                 logits_processors=[capture]))])
    assert seen[0].tolist() == [[1.0, -2.0, 0.5]]
    assert out.token_ids == [0]
    assert logits.tolist() == [[2.0, -4.0, 1.0]]


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p", "min_p"),
    [
        (4.0, 0, 0.9, 0.0),     # peaked: top-p settles within the first 256 logits
        (0.3, 0, 0.9, 0.0),     # flat: top-p needs most of the vocabulary (full sort)
        (0.3, 256, 1.0, 0.0),   # k equal to the window: ties could spill, exact either way
        (0.3, 300, 0.95, 0.0),  # k beyond the window, renormalised top-p inside it
        (1.0, 40, 0.5, 0.05),
        (1.0, -1, 1.0, 0.2),
    ],
)
def test_apply_filters_matches_the_definition_on_a_large_vocabulary(
        scale: float, top_k: int, top_p: float, min_p: float) -> None:
    vocab = 2000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11)) * scale
    logits[2, 100:700] = logits[2, 5]  # a wide tie around the boundary
    out = apply_filters(logits, [top_k] * 3, [top_p] * 3, [min_p] * 3)
    for r in range(3):
        expected = _expected_distribution(logits[r].tolist(), 1.0, max(top_k, 0), top_p, min_p)
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        expected_support = {t for t, p in enumerate(expected) if p > 0}
        if r < 2 or top_p >= 1.0:
            assert kept == expected_support
        else:  # top-p cuts among exact ties in an arbitrary order: same count, same sure part
            assert len(kept) == len(expected_support)
            assert {t for t in expected_support if logits[r, t] > logits[r, 5]} <= kept
        assert torch.equal(out[r][torch.isfinite(out[r])], logits[r][torch.isfinite(out[r])])


def test_penalties_match_a_dense_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(12)
    vocab, num_rows = 64, 8
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    captured: list[torch.Tensor] = []

    def capture(x: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
        captured.append(x.clone())
        return x

    rows, expected = [], logits.clone()
    for r in range(num_rows):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),),
                               generator=gen).tolist()
        output = torch.randint(0, 8, (r * 2,), generator=gen).tolist()  # repeats likely
        params = SamplingParams(temperature=0.0, repetition_penalty=[1.0, 1.4, 0.7][r % 3],
                                frequency_penalty=[0.0, 0.3, -0.4, 1.1][r % 4],
                                presence_penalty=[0.6, 0.0, -1.0][r % 3] if r != 5 else 0.0,
                                logits_processors=[capture])
        rows.append(_row(params, prompt=prompt, output=output))
        for t in set(prompt) | set(output):
            v = expected[r, t]
            expected[r, t] = v * params.repetition_penalty if v < 0 else v / params.repetition_penalty
        for t in set(output):
            expected[r, t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    Sampler()(logits, rows)
    got = torch.cat(captured)  # one processor list per row: rows come back in order
    assert torch.allclose(got, expected, atol=1e-6)
