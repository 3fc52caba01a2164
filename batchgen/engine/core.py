"""EngineCore: the step loop over the paged KV cache.

Each step: the scheduler plans (allocation, copy-on-write, preemption), the model runner runs
one packed forward, then every sequence that reached its last token gets a new token (the
sampler, or :func:`batchgen.engine.beam_step.beam_step`, which takes the core as its
``BeamHost``), the output processor applies the stop rules, and finished requests leave at
once, freeing their blocks.

A request whose logits processors (a constraint, a plugin's sampler) leave it no token fails
alone: its output carries the error naming the processor, and the rest of the step goes on.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence as Seq
from typing import Any

import torch

from batchgen.engine import prompt_logprobs, prompts
from batchgen.engine.beam_step import beam_step
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.config import EngineConfig
from batchgen.engine.detokenizer import IncrementalDetokenizer
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.output_processor import OutputProcessor
from batchgen.engine.outputs import EngineStats, Request, RequestOutput
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.sampling.beam_ranking import BeamSearchState
from batchgen.sampling.params import BeamSearchParams, SamplingParams, is_stateful
from batchgen.sampling.sampler import MaskedRowsError, Sampler, SamplerOutput, SamplingRow, explain_masked
from batchgen.structured import StructuredOutputsProcessor

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


class EngineCore:
    """The scheduler, the block manager, the model runner and the sampler, driven one step at a
    time: :meth:`add_request`, then :meth:`step` while :attr:`has_unfinished`.

    Args:
        config: the engine's settings.
        runner: the loaded model and its KV cache.
        tokenizer: the model's HF tokenizer (prompts in, text out).
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Any) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          window=runner.kv_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.scheduler.max_loras = config.max_loras if config.enable_lora else 0
        self.sampler = Sampler(fused_greedy=runner.linear_backend == "cpu")
        self.eos_token_ids: list[int] = runner.eos_token_ids()
        self.output = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler.free_seq)
        self.seed = config.seed
        self._structured: Any = None  # the StructuredOutputsProcessor, made on first use
        self._arrivals = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_prefill_tokens = 0
        self._num_steps = 0
        self._physical_blocks = 0
        self._logical_blocks = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue one request for the next :meth:`step`. Returns the request's error output at
        once when it can never run (e.g. its prompt cannot fit), else None."""
        group = self._make_group(request)
        error = group.error or self.scheduler.add(group)
        if error is None:
            return None
        group.error = error
        return self.make_output(group)

    @property
    def has_unfinished(self) -> bool:
        """Whether a queued or running request is left for :meth:`step`."""
        return self.scheduler.has_unfinished

    def abort_all(self) -> int:
        """Drop every queued and running request, freeing their blocks; returns how many."""
        groups = list(self.scheduler.waiting) + list(self.scheduler.running)
        for group in groups:
            self.scheduler.finish_group(group)
        self.scheduler.waiting.clear()
        return len(groups)

    def _make_group(self, request: Request) -> SequenceGroup:
        params = request.params
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"request {request.request_id!r}: params must be SamplingParams or "
                            f"BeamSearchParams, got {type(params).__name__}")
        prompt_text, token_ids = prompts.token_ids_of(request.prompt, 0, self.tokenizer)
        self._arrivals += 1
        group = SequenceGroup(request.request_id, prompt_text, list(token_ids), params, self._arrivals)
        group.stats.num_prompt_tokens = len(token_ids)
        group.error = prompts.request_error(token_ids, params, self.runner.vocab_size, self.max_model_len,
                                            self.config.max_logprobs)
        if group.error is not None:
            return group
        seq = Sequence(prompt_logprobs.scoring_tokens(params, token_ids), index=0)
        if request.lora_request is not None:
            group.error = self.runner.register_lora(request.lora_request)
            if group.error is not None:
                return group
            seq.lora_int_id = group.lora_int_id = request.lora_request.lora_int_id
        self._init_seq(group, seq)
        group.seqs.append(seq)
        group.processors = [p for p in params.logits_processors if is_stateful(p)]
        try:
            if params.structured_outputs is not None:
                group.processors.append(self.structured_processor())
            # Made now so that a grammar compiles while other requests' steps run.
            seq.processor_states = [p.new_state(list(token_ids), params) for p in group.processors]
        except (ValueError, ImportError) as exc:  # a constraint that does not compile, no xgrammar
            group.error = str(exc)
            return group
        if isinstance(params, BeamSearchParams):
            checker = self.output.stop_string_checker(params) if params.stop else None
            group.beam_state = BeamSearchState(params, self.eos_token_ids, stop_checker=checker)
        self._num_prompt_tokens += len(token_ids)
        return group

    def structured_processor(self) -> Any:
        """The engine's :class:`batchgen.structured.StructuredOutputsProcessor`, shared by every
        constrained request (so its grammar cache and its batched mask fill are too); made on
        first use. Raises ImportError when xgrammar is missing."""
        if self._structured is None:
            self._structured = StructuredOutputsProcessor(
                self.tokenizer, self.runner.vocab_size, self.eos_token_ids,
                max_threads=max(1, min(8, torch.get_num_threads())))
        return self._structured

    def states(self, group: SequenceGroup, seq: Sequence) -> list[Any]:
        """``seq``'s processor states; built again from its tokens when it has none (after a
        preemption by recompute): fresh states that accept every generated token."""
        if seq.processor_states is None:
            states = [p.new_state(seq.prompt_token_ids, group.params) for p in group.processors]
            for token in seq.output_token_ids:
                for state in states:
                    state.accept_token(token)
            seq.processor_states = states
        return seq.processor_states

    def _base_seed(self, group: SequenceGroup) -> int | None:
        seed = getattr(group.params, "seed", None)
        if seed is not None:
            return int(seed)
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + zlib.crc32(group.request_id.encode())) & _SEED_MASK

    def _init_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Per-sequence generator (seeded from the request seed and the sample index) and
        detokenizer."""
        params = group.params
        if isinstance(params, SamplingParams) and not params.is_greedy:
            base = self._base_seed(group)
            if base is not None:
                seed = base if seq.index == 0 else (base * 6_364_136_223_846_793_005 + seq.index) & _SEED_MASK
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    # ------------------------------------------------------------------ the step
    def step(self) -> tuple[list[RequestOutput], int]:
        """Run one step; returns the requests that finished in it and the tokens generated."""
        plan = self.scheduler.schedule()
        finished = [self.make_output(g) for g in plan.errored]
        if plan.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue cannot be admitted: fail it rather
                # than spin (add() already rejects what can never fit, so this is a guard).
                group = self.scheduler.waiting.popleft()
                group.error = "the request could not be scheduled with the whole KV cache free"
                finished.append(self.make_output(group))
            return finished, 0
        self._num_steps += 1
        seq_to_group = {id(s): g for g in self.scheduler.running for s in g.seqs}
        # A scoring-only request samples nothing: its last position scores its last prompt token.
        sample = [seq.num_computed_tokens + n == seq.num_tokens
                  and not prompt_logprobs.is_scoring_only(seq_to_group[id(seq)].params)
                  for seq, n in plan.scheduled]
        scores = prompt_logprobs.plan_scores(plan.scheduled, seq_to_group)
        logits = self.runner.execute(plan.scheduled, sample, plan.copies, scores)
        self._computed(plan.scheduled, seq_to_group, scores)
        num_new = self._sample_groups(self._rows_by_group(plan.scheduled, sample, seq_to_group), logits)
        self._num_generated_tokens += num_new
        for group in list(self.scheduler.running):
            self._account_blocks(group)
            if group.is_finished:
                self.scheduler.finish_group(group)
                finished.append(self.make_output(group))
        return finished, num_new

    def _computed(self, scheduled: list[tuple[Sequence, int]], seq_to_group: dict[int, SequenceGroup],
                  scores: Any) -> None:
        """After the forward pass: count the computed tokens, cache the full blocks, store the
        prompt scores and finish the scoring-only sequences."""
        for i, (seq, n) in enumerate(scheduled):
            if n > 1 or seq.num_output_tokens == 0 or seq.num_computed_tokens + 1 < seq.num_tokens:
                self._num_prefill_tokens += n  # all but decodes: prompts, and recomputes
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            group = seq_to_group[id(seq)]
            if scores is not None and scores[i] is not None:
                prompt_logprobs.store(group, scores[i])
            if seq.num_computed_tokens == seq.num_tokens and prompt_logprobs.is_scoring_only(group.params):
                self.output.finish_seq(seq, "length", None)

    @staticmethod
    def _rows_by_group(scheduled: list[tuple[Sequence, int]], sample: list[bool],
                       seq_to_group: dict[int, SequenceGroup],
                       ) -> dict[int, tuple[SequenceGroup, list[tuple[Sequence, int]]]]:
        """The sampling sequences grouped by request, each with its row in the logits."""
        rows_by_group: dict[int, tuple[SequenceGroup, list[tuple[Sequence, int]]]] = {}
        row = 0
        for (seq, _), samples in zip(scheduled, sample):
            if samples:
                group = seq_to_group[id(seq)]
                rows_by_group.setdefault(id(group), (group, []))[1].append((seq, row))
                row += 1
        return rows_by_group

    def _sample_groups(self, rows_by_group: dict[int, tuple[SequenceGroup, list[tuple[Sequence, int]]]],
                       logits: torch.Tensor) -> int:
        """A beam step per beam-search request, one sampler call for all the others; returns the
        number of new tokens."""
        num_new = 0
        sampling_rows: list[SamplingRow] = []
        sampling_seqs: list[tuple[SequenceGroup, Sequence]] = []
        sampling_logit_rows: list[int] = []
        for group, entries in rows_by_group.values():
            if group.beam_state is not None:
                num_new += beam_step(self, group, entries, logits)
                continue
            if not group.forked:
                entries = self._fork_samples(group, entries)
            for seq, r in entries:
                sampling_rows.append(self._sampling_row(group, seq))
                sampling_seqs.append((group, seq))
                sampling_logit_rows.append(r)
        if sampling_rows:
            result, sampling_seqs = self._sample(logits, sampling_rows, sampling_seqs, sampling_logit_rows)
            append = self.output.append
            for i, (group, seq) in enumerate(sampling_seqs):
                top = result.top_logprobs[i] if result.top_logprobs else None
                append(group, seq, result.token_ids[i], result.logprobs[i], top)
                num_new += 1
        return num_new

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                seqs: list[tuple[SequenceGroup, Sequence]], logit_rows: list[int],
                ) -> tuple[SamplerOutput, list[tuple[SequenceGroup, Sequence]]]:
        """The sampler over the rows; a request with a row that nothing can be sampled from
        gets its error (naming the processor) and leaves the batch, and the others are sampled
        again without it (a row's token never depends on the other rows)."""
        while True:
            try:
                return self.sampler(_rows_of(logits, logit_rows), rows), seqs
            except MaskedRowsError as exc:
                for i in exc.rows:
                    group = seqs[i][0]
                    if group.error is None:
                        group.error = explain_masked(logits[logit_rows[i]], rows[i])
                keep = [i for i, (group, _) in enumerate(seqs) if group.error is None]
                rows = [rows[i] for i in keep]
                seqs = [seqs[i] for i in keep]
                logit_rows = [logit_rows[i] for i in keep]
                if not keep:
                    return SamplerOutput([], [], []), seqs

    def _sampling_row(self, group: SequenceGroup, seq: Sequence) -> SamplingRow:
        params: SamplingParams = group.params
        suppress: Seq[int] = ()
        if seq.num_output_tokens < params.min_tokens:
            suppress = self.output.stop_ids(params)
        if not group.processors:
            return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids,
                               output_token_ids=seq.output_token_ids, generator=seq.generator,
                               suppress_token_ids=suppress)
        return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids, generator=seq.generator,
                           suppress_token_ids=suppress, processors=group.processors,
                           states=self.states(group, seq))

    def _fork_samples(self, group: SequenceGroup, entries: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """After the prompt's prefill: fork it into best_of (or n) samples sharing its blocks.

        Every child shares all blocks of the prompt, the partial last one included; the first
        write into a shared block copies only that block.
        """
        group.forked = True
        params: SamplingParams = group.params
        total = params.best_of or params.n
        (parent, r), = entries
        for i in range(1, total):
            child = parent.fork(index=i)
            self.block_manager.fork(parent, child)
            self._init_seq(group, child)
            group.seqs.append(child)
        return [(s, r) for s in group.seqs]

    # ------------------------------------------------------------------ accounting & output
    def _account_blocks(self, group: SequenceGroup) -> None:
        live = [s for s in group.seqs if s.block_table]
        if not live:
            return
        bm = self.block_manager
        held = ([[b for b in s.block_table if not bm.is_null(b)] for s in live] if bm.window  # not released ones
                else [s.block_table for s in live])
        logical = sum(map(len, held))
        physical = len({b for table in held for b in table}) if len(live) > 1 else logical
        st = group.stats
        if logical > st.num_logical_blocks:
            st.num_logical_blocks = logical
            st.num_physical_blocks = max(st.num_physical_blocks, physical)
        elif physical > st.num_physical_blocks:
            st.num_physical_blocks = physical

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The request's output; a failed request is dropped from the scheduler first."""
        if group.error is not None:
            self.scheduler.finish_group(group)
            return self.output.make_output(group)
        out = self.output.make_output(group)
        self._physical_blocks += group.stats.num_physical_blocks
        self._logical_blocks += group.stats.num_logical_blocks
        return out

    def stats(self) -> EngineStats:
        """Run-level counters since this engine was created."""
        bm = self.block_manager
        return EngineStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size,
            kv_cache_bytes=self.runner.kv_cache.num_bytes, peak_blocks_used=bm.peak_blocks_used,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_hit_blocks=bm.prefix_cache_hit_blocks, num_evictions=bm.num_evictions,
            num_released_blocks=bm.num_released_blocks,
            num_preemptions=self.scheduler.num_preemptions, num_cow_copies=bm.num_cow_copies,
            num_prompt_tokens=self._num_prompt_tokens, num_generated_tokens=self._num_generated_tokens,
            num_prefill_tokens=self._num_prefill_tokens, num_steps=self._num_steps,
            physical_blocks=self._physical_blocks, logical_blocks=self._logical_blocks,
        )


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``; ``logits`` itself when those are all its rows in order (the common
    step: a copy of its ``[rows, vocab]`` would be 37 MiB at 64 rows of a 151,936-token
    vocabulary). The sampler never modifies the logits it is given."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long))
