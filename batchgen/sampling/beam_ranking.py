"""Beam-search bookkeeping that reproduces HF transformers' ``_beam_search`` exactly.

Pure Python (this is an engine-core module: no torch). The engine runs the model; this module
decides, from each live beam's top candidates, which beams live on, which hypotheses are
finished, when the search is over, and what is returned.

HF's algorithm, per request (``k = beam_width``, ``K = max(2, 1 + n_finishing_ids) * k``):

1. Each candidate's cumulative logprob is ``beam_logprob + token_logprob``. The ``K`` best
   candidates over all beams are taken, best first.
2. A candidate "hits a stopping criterion" when its token is an EOS / stop id, when a stop
   checker says so, or when it reaches ``max_tokens`` generated tokens (then all do).
3. The next live beams are the ``k`` best candidates that did not hit a criterion.
4. Only the candidates ranked within the first ``k`` of the ``K`` that hit a criterion become
   finished hypotheses, scored ``cumulative_logprob / generated_length ** length_penalty``
   where ``generated_length`` counts the generated tokens including the final (EOS) token and
   excluding the prompt. The ``k`` best-scoring hypotheses are kept.
5. Termination after each step: the search stops when (a) the early-stopping heuristic says no
   live beam can beat the worst kept hypothesis, or (b) ``early_stopping is True`` and ``k``
   hypotheses are kept, or (c) every candidate hit a criterion (``max_tokens``).
   The heuristic only applies once ``k`` hypotheses are kept; it compares
   ``best_live_cumulative / L ** length_penalty`` against the worst kept score, with ``L`` the
   current generated length, except for ``early_stopping == "never"`` with
   ``length_penalty > 0``, where ``L = max_tokens`` (the best length a live beam could reach).
6. The result is the ``num_return_sequences`` best hypotheses; their scores are HF's
   ``sequences_scores``.

HF does this arithmetic in float32 tensors; this module rounds every sum and quotient to
float32 the same way, so that rankings and scores agree bit for bit given the same logprobs.
On the first step HF starts ``k`` copies of the prompt, all but one with a cumulative logprob of
``-1e9``, so that only the first copy's candidates are chosen; here the engine passes the
single prompt beam, which is equivalent whenever the vocabulary holds at least ``K`` tokens.

``min_tokens`` is honoured as HF's ``MinNewTokensLengthLogitsProcessor`` does (EOS logprob set to
``-inf`` after log-softmax, no renormalisation): finishing candidates are dropped while fewer
than ``min_tokens`` tokens have been generated.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from batchgen.sampling.params import BeamSearchParams

__all__ = ["BeamHypothesis", "BeamSearchState", "beam_candidates_per_beam"]

_F32 = struct.Struct("<f")

#: HF marks impossible entries by adding this to a float32 score.
_HF_NEG = -1.0e9


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (as a torch float32 tensor would hold it).

    For ``+``, ``-``, ``*`` and ``/`` on float32 inputs, computing in float64 and rounding once
    gives exactly the float32 result, so ``_f32(a + b)`` emulates a float32 addition.
    """
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # beyond float32 range: float32 arithmetic would give +-inf
        return math.copysign(math.inf, x)


def _length_divisor(generated_length: int, length_penalty: float) -> float:
    """``generated_length ** length_penalty`` as HF divides by it: a Python float (float64),
    converted to float32 when it meets the float32 score tensor."""
    return _f32(generated_length ** length_penalty)


def _hf_score(cumulative_logprob: float, generated_length: int, length_penalty: float) -> float:
    """HF's beam score: ``sum_logprobs / generated_length ** length_penalty`` in float32."""
    return _f32(cumulative_logprob / _length_divisor(generated_length, length_penalty))


def beam_candidates_per_beam(beam_width: int, num_finishing_ids: int) -> int:
    """How many top candidates per live beam the engine must pass to :meth:`BeamSearchState.step`:
    HF's ``max(2, 1 + num_eos) * beam_width``, enough for the global top candidates to hold
    ``beam_width`` beams that do not finish even if every beam's best tokens are EOS."""
    return max(2, 1 + num_finishing_ids) * beam_width


@dataclass(frozen=True)
class BeamHypothesis:
    """One finished beam.

    * ``token_ids``: the generated tokens (no prompt), as HF returns them: the EOS / stop token
      that ended the hypothesis is included.
    * ``score``: HF's ``sequences_scores``: ``cumulative_logprob / len(token_ids) **
      length_penalty`` (float32-rounded).
    * ``cumulative_logprob``: sum of the chosen tokens' logprobs (float32-rounded).
    * ``finish_token_id``: the EOS / stop token id that ended it, or None when it ended by
      reaching ``max_tokens`` or a stop checker.
    """

    token_ids: tuple[int, ...]
    score: float
    cumulative_logprob: float
    finish_token_id: int | None = None


@dataclass
class _Candidate:
    parent: int
    token_id: int
    cumulative: float
    finishing: bool


class BeamSearchState:
    """Beam-search state of one request; see the module docstring for the algorithm.

    ``eos_token_ids`` are the model's EOS ids; ``params.stop_token_ids`` end a beam the same
    way. With ``params.ignore_eos`` only the stop ids do. ``stop_checker``, when given, is called
    with a candidate's generated token ids (the candidate token last) and returns True when they
    end in a stop string; such a candidate finishes like an EOS one (as HF's stop-string
    criterion does).
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: Collection[int],
                 stop_checker: Callable[[Sequence[int]], bool] | None = None) -> None:
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        self.params = params
        finishing = set(params.stop_token_ids)
        if not params.ignore_eos:
            finishing.update(int(t) for t in eos_token_ids)
        #: token ids that end a beam (EOS unless ignore_eos, plus the stop ids).
        self.finishing_token_ids: frozenset[int] = frozenset(finishing)
        #: candidates per live beam that :meth:`step` needs (HF's ``beams_to_keep``).
        self.num_candidates: int = beam_candidates_per_beam(params.beam_width, len(finishing))
        self._stop_checker = stop_checker
        # Kept hypotheses, best first, at most beam_width (HF's `sequences` / `beam_scores`).
        self._finished: list[BeamHypothesis] = []
        # HF's `is_early_stop_heuristic_unsatisfied`: sticky, once False it stays False.
        self._improvement_possible = True
        self._done = False
        self._num_steps = 0

    # ----------------------------------------------------------------------------- queries
    @property
    def done(self) -> bool:
        """True once the search is over: :meth:`step` returned ``[]``."""
        return self._done

    @property
    def num_finished(self) -> int:
        """Number of finished hypotheses currently kept (at most ``beam_width``)."""
        return len(self._finished)

    @property
    def finished_hypotheses(self) -> list[BeamHypothesis]:
        """The kept finished hypotheses, best score first (a copy)."""
        return list(self._finished)

    # ------------------------------------------------------------------------------- step
    def step(self, beam_token_ids: list[list[int]], beam_logprobs: list[float],
             candidates: list[list[tuple[int, float]]]) -> list[tuple[int, int, float]]:
        """Advance the search by one token.

        ``beam_token_ids[i]``: generated tokens so far of live beam ``i`` (not the prompt; all
        live beams have the same length). ``beam_logprobs[i]``: its cumulative logprob.
        ``candidates[i]``: beam ``i``'s top next tokens as ``(token_id, token_logprob)``, at
        least :attr:`num_candidates` of them (fewer only if the vocabulary is smaller), with
        logprobs from log-softmax of the model's float32 logits. On the first step there is one
        live beam (the prompt) with no tokens and logprob 0.

        Returns the next live beams as ``(parent_index, token_id, new_cumulative_logprob)``,
        best first, at most ``beam_width``; records finished hypotheses. Returns ``[]`` when
        the search is over (then :attr:`done` is True and :meth:`finalize` gives the result).
        """
        if self._done:
            raise RuntimeError("step() called after the beam search finished")
        generated = self._check_beams(beam_token_ids, beam_logprobs, candidates)
        new_length = generated + 1
        k = self.params.beam_width
        ranked = self._rank(beam_token_ids, beam_logprobs, candidates, generated)

        # 3. Next live beams: the k best that did not finish (the order is kept: best first).
        running = [c for c in ranked if not c.finishing][:k]

        # 4. Finished hypotheses: only finishing candidates ranked within the first k count.
        # (HF also freezes the kept set once the heuristic is satisfied or, with
        # early_stopping=True, once it is full; both end the search first, see step 5.)
        new_hyps = [
            BeamHypothesis(
                token_ids=(*beam_token_ids[c.parent], c.token_id),
                score=_hf_score(c.cumulative, new_length, self.params.length_penalty),
                cumulative_logprob=c.cumulative,
                finish_token_id=c.token_id if c.token_id in self.finishing_token_ids else None,
            )
            for c in ranked[:k] if c.finishing
        ]
        self._merge_finished(new_hyps)
        self._num_steps += 1
        if self._search_over(ranked, running, new_length):
            self._done = True
            return []
        return [(c.parent, c.token_id, c.cumulative) for c in running]

    def _check_beams(self, beam_token_ids: list[list[int]], beam_logprobs: list[float],
                     candidates: list[list[tuple[int, float]]]) -> int:
        """Check :meth:`step`'s arguments agree; return the live beams' generated length."""
        n = len(beam_token_ids)
        if not (n == len(beam_logprobs) == len(candidates)) or n == 0:
            raise ValueError(
                "beam_token_ids, beam_logprobs and candidates must have the same non-zero "
                f"length, got {len(beam_token_ids)}, {len(beam_logprobs)}, {len(candidates)}")
        k = self.params.beam_width
        if n > k:
            raise ValueError(f"got {n} live beams, more than beam_width ({k})")
        generated = len(beam_token_ids[0])
        if any(len(t) != generated for t in beam_token_ids):
            raise ValueError("all live beams must have the same number of generated tokens")
        return generated

    def _rank(self, beam_token_ids: list[list[int]], beam_logprobs: list[float],
              candidates: list[list[tuple[int, float]]], generated: int) -> list[_Candidate]:
        """Steps 1 and 2: the ``num_candidates`` best candidates, best first, each marked with
        whether it hits a stopping criterion."""
        at_max_length = generated + 1 >= self.params.max_tokens
        suppress_finishing = generated < self.params.min_tokens
        # 1. All candidates with their float32 cumulative logprobs. Sorting by (score desc,
        # beam, token) ranks ties by the flattened (beam * vocab + token) index, as top-k does.
        pool: list[tuple[float, int, int]] = []
        for parent, (cum, cands) in enumerate(zip(beam_logprobs, candidates)):
            cum32 = _f32(cum)
            for token_id, logprob in cands:
                if suppress_finishing and token_id in self.finishing_token_ids:
                    continue  # HF sets their logprob to -inf (MinNewTokensLengthLogitsProcessor)
                pool.append((_f32(cum32 + _f32(logprob)), parent, token_id))
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[: self.num_candidates]

        # 2. Which candidates hit a stopping criterion.
        ranked: list[_Candidate] = []
        for cum, parent, token_id in top:
            finishing = at_max_length or token_id in self.finishing_token_ids
            if not finishing and self._stop_checker is not None:
                finishing = bool(self._stop_checker([*beam_token_ids[parent], token_id]))
            ranked.append(_Candidate(parent, token_id, cum, finishing))
        return ranked

    def _search_over(self, ranked: list[_Candidate], running: list[_Candidate], new_length: int) -> bool:
        """Step 5, termination (HF's `_check_early_stop_heuristic` and
        `_beam_search_has_unfinished_sequences`), with cur_len - prompt_len = new_length."""
        k = self.params.beam_width
        full = len(self._finished) >= k
        if full and running:
            if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
                best_length = self.params.max_tokens
            else:
                best_length = new_length
            best_possible = _f32(running[0].cumulative
                                 / _length_divisor(best_length, self.params.length_penalty))
            worst_kept = self._finished[-1].score
            if not best_possible > worst_kept:
                self._improvement_possible = False
        all_hit_criteria = all(c.finishing for c in ranked)
        return bool(not self._improvement_possible
                    or (full and self.params.early_stopping is True)
                    or all_hit_criteria or not running)

    def _merge_finished(self, new_hyps: list[BeamHypothesis]) -> None:
        """Keep the ``beam_width`` best of the kept and the new hypotheses (HF's merged top-k:
        on equal scores the already kept one wins, then the better-ranked candidate)."""
        if not new_hyps:
            return
        merged = self._finished + new_hyps
        order = sorted(range(len(merged)), key=lambda i: (-merged[i].score, i))
        self._finished = [merged[i] for i in order[: self.params.beam_width]]

    # --------------------------------------------------------------------------- finalize
    def finalize(self, beam_token_ids: list[list[int]] | None = None,
                 beam_logprobs: list[float] | None = None) -> list[BeamHypothesis]:
        """Return the ``num_return_sequences`` best hypotheses, best score first.

        Call it when :attr:`done` is True (the arguments are then ignored and may be omitted),
        or to cut the search short (e.g. the context is full): the live beams given are then
        offered as finished hypotheses scored on their own length, and the search is over.
        """
        if not self._done:
            live = list(zip(beam_token_ids or [], beam_logprobs or []))
            hyps = [
                BeamHypothesis(tuple(tokens), _hf_score(_f32(cum), len(tokens),
                                                        self.params.length_penalty), _f32(cum))
                for tokens, cum in live if tokens
            ]
            # HF ranks the live beams by cumulative logprob before scoring; only k can enter.
            hyps.sort(key=lambda h: -h.cumulative_logprob)
            self._merge_finished(hyps[: self.params.beam_width])
            self._done = True
        assert self.params.num_return_sequences is not None  # resolved by BeamSearchParams
        return self._finished[: self.params.num_return_sequences]
