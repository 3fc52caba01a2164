"""The beam step: one beam-search request's turn in an engine step.

The ranking (which candidates live on, which hypotheses finish, when the search ends) is
:class:`batchgen.sampling.beam_ranking.BeamSearchState`, pure Python and pinned against HF. This
module is the engine side of it: the log-softmax and top-k over the beams' logits rows, the
logits processors, and the paged cache: a survivor with several children is forked (sharing
its blocks; only the partial last block is copied, on its next write), a dead beam's blocks are
freed at once, and the final hypotheses become the group's finished sequences.

:func:`beam_step` takes the engine as a :class:`BeamHost`: the few parts of it a beam step
touches (the block manager, the scheduler, the output processor, the context length and the
processor states). :class:`batchgen.engine.core.EngineCore` is one; this module does not
import it, so the engine core depends on the beam step and not the other way round.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch

from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.sampling.beam_ranking import BeamHypothesis, BeamSearchState
from batchgen.sampling.params import BeamSearchParams, is_stateful
from batchgen.sampling.processors import describe_processor
from batchgen.sampling.stateful import apply_stateful

if TYPE_CHECKING:
    from batchgen.engine.block_manager import BlockManager
    from batchgen.engine.output_processor import OutputProcessor
    from batchgen.engine.scheduler import Scheduler


class BeamHost(Protocol):
    """What :func:`beam_step` uses of the engine (``EngineCore`` provides it)."""

    block_manager: BlockManager  # forks a survivor's blocks for its extra children
    scheduler: Scheduler  # frees a dead beam's and a finished search's sequences
    output: OutputProcessor  # decodes a final hypothesis
    max_model_len: int  # the search ends when the context is full

    def states(self, group: SequenceGroup, seq: Sequence) -> list[Any]:
        """``seq``'s logits-processor states (rebuilt from its tokens when missing)."""
        ...


def beam_step(core: BeamHost, group: SequenceGroup, entries: list[tuple[Sequence, int]],
              logits: torch.Tensor) -> int:
    """Advance ``group``'s search by one token; returns the number of live beams after it.

    ``entries`` are the group's live beams with their row in ``logits``. Sets ``group.error``
    (and returns 0) when the logits processors leave no beam any allowed token before any
    hypothesis finished: the request fails alone, naming the processor.
    """
    state: BeamSearchState = group.beam_state
    beams = [s for s, _ in entries]
    candidates, processed, states = _candidates(core, group, beams, [r for _, r in entries], logits)
    if processed:  # only the continuations the processors allow are ranked
        candidates = [[(t, lp) for t, lp in c if lp != -math.inf] for c in candidates]
        if not any(candidates) and not state.num_finished:
            group.error = _masked_error(group, beams, states)
            return 0
    chosen = state.step([b.output_token_ids for b in beams], [b.cumulative_logprob for b in beams], candidates)
    group.forked = True
    new_seqs = _advance(core, beams, chosen)
    group.seqs = new_seqs
    if new_seqs and new_seqs[0].num_tokens < core.max_model_len:
        return len(new_seqs)
    # The search is over (or the context is full): settle the hypotheses.
    hyps = state.finalize([s.output_token_ids for s in new_seqs], [s.cumulative_logprob for s in new_seqs])
    for s in new_seqs:
        core.scheduler.free_seq(s)
    group.seqs = []
    for i, h in enumerate(hyps):
        group.finished_seqs.append(_finished_seq(core, group, i, h))
    return len(new_seqs)


def _candidates(core: BeamHost, group: SequenceGroup, beams: list[Sequence], rows: list[int],
                logits: torch.Tensor) -> tuple[list[list[tuple[int, float]]], bool, list[list[Any]] | None]:
    """Each beam's top ``num_candidates`` next tokens as ``(token_id, logprob)``, after the
    logits processors; whether any processor ran; the stateful processors' states."""
    params: BeamSearchParams = group.params
    state: BeamSearchState = group.beam_state
    logprobs = torch.log_softmax(logits.index_select(0, torch.tensor(rows, dtype=torch.long)).float(), dim=-1)
    processed = bool(params.logits_processors)
    if processed:
        # As HF applies its processors in beam search: on the log-softmax scores, so that a
        # masked token drops out and the others keep their logprobs.
        outputs = [b.output_token_ids for b in beams]
        for proc in params.logits_processors:
            if not is_stateful(proc):
                logprobs = proc(logprobs, outputs).float()
    states = None
    if group.processors:
        processed = True
        states = [core.states(group, b) for b in beams]
        apply_stateful(logprobs, [group.processors] * len(beams), states)
    top_lp, top_ids = torch.topk(logprobs, min(state.num_candidates, logprobs.shape[-1]), dim=-1)
    return [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())], processed, states


def _advance(core: BeamHost, beams: list[Sequence], chosen: list[tuple[int, int, float]]) -> list[Sequence]:
    """The next live beams: each chosen ``(parent, token, cumulative)`` extends its parent (the
    parent's last child is the parent itself, the others are forks); dead beams are freed."""
    remaining: dict[int, int] = {}
    for parent_idx, _, _ in chosen:
        remaining[parent_idx] = remaining.get(parent_idx, 0) + 1
    new_seqs: list[Sequence] = []
    for parent_idx, token, cum in chosen:
        parent = beams[parent_idx]
        remaining[parent_idx] -= 1
        if remaining[parent_idx] > 0:
            # More children follow: fork now, while the parent still has its old tokens.
            seq = parent.fork(index=len(new_seqs))
            core.block_manager.fork(parent, seq)
        else:
            seq = parent  # the last child takes the parent itself
        seq.token_ids.append(token)
        seq.cumulative_logprob = cum
        if seq.processor_states:
            for pstate in seq.processor_states:
                pstate.accept_token(token)
        new_seqs.append(seq)
    alive = {id(s) for s in new_seqs}
    for b in beams:
        if id(b) not in alive:
            core.scheduler.free_seq(b)  # a dead beam: its blocks go back at once
    return new_seqs


def _finished_seq(core: BeamHost, group: SequenceGroup, index: int, h: BeamHypothesis) -> Sequence:
    """Final hypothesis ``index`` as a finished sequence (text decoded, stop token or string cut)."""
    params: BeamSearchParams = group.params
    ids = list(h.token_ids)
    if h.finish_token_id is not None:
        ids = ids[:-1]  # the stop token is not emitted
    done = Sequence(group.prompt_token_ids, index=index)
    done.token_ids.extend(ids)
    done.text = core.output.decode(ids, params.skip_special_tokens)
    done.cumulative_logprob = h.cumulative_logprob
    done.finish_reason = "length"
    if h.finish_token_id is not None:
        done.finish_reason = "stop"
        done.stop_reason = h.finish_token_id if h.finish_token_id in params.stop_token_ids else None
    hits = [(done.text.find(stop), stop) for stop in params.stop if stop in done.text]
    if hits:  # ended by a stop string: the string is not emitted
        pos, stop = min(hits)
        done.text = done.text[:pos]
        done.finish_reason, done.stop_reason = "stop", stop
    done.score = h.score
    done.status = SequenceStatus.FINISHED
    return done


def _masked_error(group: SequenceGroup, beams: list[Sequence], states: list[list[object]] | None) -> str:
    params: BeamSearchParams = group.params
    names = [describe_processor(p) for p in params.logits_processors if not is_stateful(p)]
    if group.processors:
        first = states[0] if states else [None] * len(group.processors)
        names += [describe_processor(p, s) for p, s in zip(group.processors, first)]
    return (f"{' and '.join(names) or 'the logits processors'} allowed no token for any beam after "
            f"{beams[0].num_output_tokens} generated token(s); nothing can be generated")
