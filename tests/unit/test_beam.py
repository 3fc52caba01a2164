"""Beam-search bookkeeping on hand-built candidates: scoring, finished hypotheses, stopping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.sampling.beam_ranking import BeamSearchState, beam_candidates_per_beam
from batchgen.sampling.params import BeamSearchParams

REPO_ROOT = Path(__file__).resolve().parents[2]
EOS = 0


def _state(**kwargs: object) -> BeamSearchState:
    params = BeamSearchParams(**{"beam_width": 2, "max_tokens": 10, **kwargs})  # type: ignore[arg-type]
    return BeamSearchState(params, eos_token_ids=[EOS])


def _first_step_with_eos_on_top(state: BeamSearchState) -> list[tuple[int, int, float]]:
    # Single live beam (the prompt). EOS ranks first, so it becomes a finished hypothesis.
    return state.step([[]], [0.0], [[(EOS, -0.5), (5, -0.75), (6, -1.0), (7, -2.0)]])


def _second_step(state: BeamSearchState) -> list[tuple[int, int, float]]:
    # Live beams: [5] (cum -0.75) and [6] (cum -1.0). Ranked cumulative candidates:
    # [5, EOS] -0.875, [5, 8] -1.0, [6, EOS] -1.0625, [6, 9] -1.125 ...
    return state.step(
        [[5], [6]], [-0.75, -1.0],
        [[(EOS, -0.125), (8, -0.25), (10, -3.0), (11, -3.5)],
         [(EOS, -0.0625), (9, -0.125), (12, -4.0), (13, -4.5)]])


def test_candidates_per_beam_follows_hf() -> None:
    assert beam_candidates_per_beam(4, 0) == 8
    assert beam_candidates_per_beam(4, 1) == 8
    assert beam_candidates_per_beam(3, 2) == 9
    assert _state(beam_width=3).num_candidates == 6
    state = BeamSearchState(BeamSearchParams(beam_width=2, stop_token_ids=[9, 10]), [EOS])
    assert state.finishing_token_ids == {EOS, 9, 10}
    assert state.num_candidates == 8


def test_eos_within_top_beam_width_becomes_a_finished_hypothesis() -> None:
    state = _state()
    live = _first_step_with_eos_on_top(state)
    assert live == [(0, 5, -0.75), (0, 6, -1.0)]  # the two best non-EOS continuations
    (hyp,) = state.finished_hypotheses
    assert hyp.token_ids == (EOS,) and hyp.finish_token_id == EOS
    assert hyp.score == -0.5 and hyp.cumulative_logprob == -0.5  # -0.5 / 1 ** 1.0
    assert not state.done


def test_eos_ranked_below_beam_width_is_discarded() -> None:
    state = _state()
    live = state.step([[]], [0.0], [[(5, -0.25), (6, -0.5), (EOS, -0.75), (7, -2.0)]])
    assert live == [(0, 5, -0.25), (0, 6, -0.5)]
    assert state.num_finished == 0


def test_parents_and_cumulative_logprobs_across_beams() -> None:
    state = _state(early_stopping="never")
    _first_step_with_eos_on_top(state)
    live = _second_step(state)
    # [5, EOS] finished (rank 0); ranks 1.. are [5, 8] and [6, 9] (the second EOS is rank 2,
    # outside the top 2, so it is discarded).
    assert live == [(0, 8, -1.0), (1, 9, -1.125)]
    assert [h.token_ids for h in state.finished_hypotheses] == [(5, EOS), (EOS,)]


def test_score_uses_generated_length_with_eos_and_length_penalty() -> None:
    state = _state(length_penalty=0.6)
    _first_step_with_eos_on_top(state)
    _second_step(state)
    # -0.875 / 2 ** 0.6 = -0.577 now ranks below (EOS,) at -0.5 / 1 ** 0.6.
    first, second = state.finished_hypotheses
    assert (first.token_ids, first.score) == ((EOS,), -0.5)
    assert second.token_ids == (5, EOS)
    assert second.cumulative_logprob == -0.875
    assert second.score == pytest.approx(-0.875 / 2**0.6, rel=1e-6)  # length 2, EOS counted


def test_early_stopping_true_stops_once_beam_width_hypotheses_exist() -> None:
    state = _state(early_stopping=True)
    _first_step_with_eos_on_top(state)
    assert _second_step(state) == []
    assert state.done
    hyps = state.finalize()
    assert [h.token_ids for h in hyps] == [(5, EOS), (EOS,)]
    assert [h.score for h in hyps] == pytest.approx([-0.4375, -0.5])  # -0.875 / 2, -0.5 / 1


def _third_step(state: BeamSearchState) -> list[tuple[int, int, float]]:
    # Live beams [5, 8] (-1.0) and [6, 9] (-1.125); no EOS in reach, every token costs 1.
    return state.step([[5, 8], [6, 9]], [-1.0, -1.125],
                      [[(20, -1.0), (21, -1.5), (22, -2.0), (23, -2.5)],
                       [(24, -1.0), (25, -1.5), (26, -2.0), (27, -2.5)]])


def test_early_stopping_false_uses_the_current_length_heuristic() -> None:
    state = _state(early_stopping=False)
    _first_step_with_eos_on_top(state)
    # After step 2 the worst kept score is -0.5; the best live beam could still reach
    # -1.0 / 2 = -0.5, which is not better, so the search stops.
    assert _second_step(state) == []
    assert state.done


def test_early_stopping_false_continues_while_a_live_beam_can_win() -> None:
    state = _state(early_stopping=False, length_penalty=2.0)
    _first_step_with_eos_on_top(state)
    # Scores: [5, EOS] -0.875 / 4; worst kept -0.5; best live -1.0 / 4 = -0.25 > -0.5.
    assert _second_step(state) != []
    # Step 3: best live -2.0 / 9 = -0.222 > -0.5: still going; it stops only when it cannot win.
    assert _third_step(state) != []


def test_early_stopping_never_bounds_with_max_tokens() -> None:
    # Same position where early_stopping=False stopped: with "never" and length_penalty > 0
    # the bound is -1.0 / max_tokens = -0.1 > -0.5, so the search goes on.
    state = _state(early_stopping="never")
    _first_step_with_eos_on_top(state)
    assert _second_step(state) == [(0, 8, -1.0), (1, 9, -1.125)]
    assert _third_step(state) == [(0, 20, -2.0), (1, 24, -2.125)]
    # With a negative length penalty "never" falls back to the current length: it stops.
    state = _state(early_stopping="never", length_penalty=-1.0)
    _first_step_with_eos_on_top(state)
    assert _second_step(state) == []


def test_max_tokens_finishes_the_top_beam_width_candidates() -> None:
    state = _state(max_tokens=2, early_stopping=False)
    state.step([[]], [0.0], [[(EOS, -0.6), (5, -0.75), (6, -1.0), (7, -2.0)]])
    assert _second_step(state) == []
    assert state.done
    hyps = state.finalize()
    # At the last step every candidate hits the length limit and the top two enter:
    # [5, EOS] -0.875 / 2 and [5, 8] -1.0 / 2; the earlier (EOS,) at -0.6 drops out.
    assert [(h.token_ids, h.finish_token_id) for h in hyps] == [((5, EOS), EOS), ((5, 8), None)]
    assert [h.score for h in hyps] == pytest.approx([-0.4375, -0.5])


def test_num_return_sequences_limits_the_result() -> None:
    state = _state(max_tokens=2, num_return_sequences=1)
    _first_step_with_eos_on_top(state)
    _second_step(state)
    assert [h.token_ids for h in state.finalize()] == [(5, EOS)]


def test_min_tokens_drops_eos_candidates() -> None:
    state = _state(min_tokens=1)
    live = _first_step_with_eos_on_top(state)
    assert live == [(0, 5, -0.75), (0, 6, -1.0)]
    assert state.num_finished == 0


def test_ignore_eos_keeps_stop_token_ids() -> None:
    params = BeamSearchParams(beam_width=2, ignore_eos=True, stop_token_ids=[7])
    state = BeamSearchState(params, eos_token_ids=[EOS])
    live = state.step([[]], [0.0], [[(EOS, -0.5), (7, -0.6), (6, -1.0), (8, -2.0)]])
    assert live == [(0, EOS, -0.5), (0, 6, -1.0)]
    assert [(h.token_ids, h.finish_token_id) for h in state.finished_hypotheses] == [((7,), 7)]


def test_stop_checker_finishes_candidates() -> None:
    params = BeamSearchParams(beam_width=2)
    state = BeamSearchState(params, [EOS], stop_checker=lambda ids: ids[-2:] == [4, 4])
    state.step([[]], [0.0], [[(4, -0.1), (5, -0.2), (6, -3.0), (7, -4.0)]])
    state.step([[4], [5]], [-0.1, -0.2], [[(4, -0.1), (9, -0.5), (1, -5.0), (2, -6.0)],
                                         [(9, -0.3), (3, -0.9), (1, -5.0), (2, -6.0)]])
    (hyp,) = state.finished_hypotheses
    assert hyp.token_ids == (4, 4) and hyp.finish_token_id is None


def test_finalize_early_offers_live_beams() -> None:
    state = _state(beam_width=3)
    live = state.step([[]], [0.0], [[(5, -1.0), (EOS, -1.5), (6, -2.0), (7, -4.0), (8, -5.0),
                                     (9, -6.0)]])
    assert live == [(0, 5, -1.0), (0, 6, -2.0), (0, 7, -4.0)]
    hyps = state.finalize([[5], [6], [7]], [-1.0, -2.0, -4.0])
    assert state.done
    assert [h.token_ids for h in hyps] == [(5,), (EOS,), (6,)]
    assert [h.score for h in hyps] == [-1.0, -1.5, -2.0]


def test_misuse_is_reported() -> None:
    state = _state(early_stopping=True, max_tokens=1)
    with pytest.raises(ValueError, match="same non-zero length"):
        state.step([[]], [0.0, 1.0], [[(1, -1.0)]])
    with pytest.raises(ValueError, match=r"got 3 live beams, more than beam_width \(2\)"):
        state.step([[1], [2], [3]], [0.0] * 3, [[(1, -1.0)]] * 3)
    with pytest.raises(ValueError, match="same number of generated tokens"):
        state.step([[1], [2, 3]], [0.0] * 2, [[(1, -1.0)]] * 2)
    assert state.step([[]], [0.0], [[(1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0)]]) == []
    with pytest.raises(RuntimeError, match="after the beam search finished"):
        state.step([[1]], [-1.0], [[(1, -1.0)]])
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        BeamSearchState("wide", [EOS])  # type: ignore[arg-type]


def test_beam_module_does_not_import_torch() -> None:
    code = ("import sys; import batchgen.sampling.beam_ranking, batchgen.sampling; "
            "batchgen.sampling.BeamSearchState; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
