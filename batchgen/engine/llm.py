"""LLM: the public engine. Owns the one step loop.

Each step: the scheduler plans (allocation, copy-on-write, preemption), the model runner runs
one packed forward, then every sequence that reached its last token gets a new token (sampler
or beam search), and finished requests leave at once, freeing their blocks.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from typing import Any

import torch

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.config import EngineConfig
from batchgen.engine.detokenizer import IncrementalDetokenizer
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import CompletionOutput, EngineStats, Prompt, Request, RequestOutput
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.sampling.beam import BeamSearchState
from batchgen.sampling.params import BeamSearchParams, SamplingParams, is_stateful
from batchgen.sampling.sampler import Sampler, SamplingRow, apply_stateful

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


class LLM:
    """Offline batch generation over a paged KV cache.

    ``LLM(config=EngineConfig(...))``, or the convenience ``LLM(model, dtype=..., ...)``: the
    keyword arguments are :class:`~batchgen.engine.config.EngineConfig`'s fields (see it for
    each setting) and build one; given both, the keywords override the config's fields.

    Raises:
        ValueError: a setting out of range (see :class:`EngineConfig`).
        TypeError: a keyword that is no engine setting.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        if config is None:
            config = EngineConfig.from_kwargs(model, **kwargs)
        elif model is not None or kwargs:
            config = EngineConfig.from_kwargs(**{**config.to_dict(), **kwargs, **({"model": model} if model else {})})
        self.config = config
        self.model_name = config.model
        self.runner = ModelRunner(config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_path,
                                                       trust_remote_code=config.trust_remote_code)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.sampler = Sampler(fused_greedy=self.runner.linear_backend == "cpu")
        self.eos_token_ids: list[int] = self.runner.eos_token_ids()
        self.seed = config.seed
        self._structured: Any = None  # the StructuredOutputsProcessor, made on first use
        self._arrivals = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_prefill_tokens = 0
        self._num_steps = 0
        self._physical_blocks = 0
        self._logical_blocks = 0
        logger.info("LLM ready: %s, %d KV blocks of %d tokens (%.1f MiB), attention backend %s, "
                    "linear backend %s", config.model, self.runner.num_blocks, config.block_size,
                    self.runner.kv_cache.num_bytes / 2**20, self.runner.attention_backend,
                    self.runner.linear_backend)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | BeamSearchParams | Seq[SamplingParams | BeamSearchParams] | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one RequestOutput per prompt, in input order.

        ``prompts`` is a list of strings or of token-id lists (a single one is accepted too);
        ``params`` is one SamplingParams / BeamSearchParams for all, or one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, BeamSearchParams)):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} params for {len(prompts)} prompts; give one, or one per prompt")
        requests = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        results: dict[str, RequestOutput] = {}
        for out in self.stream(requests, on_tokens=on_tokens):
            results[out.request_id] = out
        return [results[r.request_id] for r in requests]

    def stream(
        self,
        requests: Iterable[Request],
        on_tokens: Callable[[int], None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Run requests, yielding each RequestOutput as soon as its request finishes.

        ``requests`` is consumed lazily: only enough to keep the batch full is read ahead.
        ``on_tokens(n)`` is called once per step with the number of tokens generated in it.
        A request that fails (e.g. a prompt that can never fit) yields an output with
        ``error`` set; the others go on.
        """
        source = iter(requests)
        try:
            yield from self._run(source, self.scheduler.lookahead, on_tokens)
        finally:
            # The caller stopped early (an exception, Ctrl-C, or it closed the generator): drop
            # what this stream left behind so that the next stream starts clean.
            self.abort_all()

    def abort_all(self) -> int:
        """Drop every queued and running request, freeing their blocks; returns how many."""
        groups = list(self.scheduler.waiting) + list(self.scheduler.running)
        for group in groups:
            self.scheduler.finish_group(group)
        self.scheduler.waiting.clear()
        return len(groups)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (as vLLM's method of the same name); False, changing
        nothing, while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def _run(self, source: Iterator[Request], lookahead: int,
             on_tokens: Callable[[int], None] | None) -> Iterator[RequestOutput]:
        exhausted = False
        while True:
            while not exhausted and len(self.scheduler.waiting) < lookahead:
                try:
                    request = next(source)
                except StopIteration:
                    exhausted = True
                    break
                rejected = self.add_request(request)
                if rejected is not None:
                    yield rejected
            if not self.scheduler.has_unfinished:
                if exhausted:
                    return
                continue
            finished, num_new = self.step()
            if on_tokens is not None and num_new:
                on_tokens(num_new)
            yield from finished

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue one request for the next :meth:`step`; for callers that drive the step loop
        themselves (an executor's replica). Returns the request's error output at once when it
        can never run (e.g. its prompt cannot fit), else None."""
        group = self._make_group(request)
        error = group.error or self.scheduler.add(group)
        if error is None:
            return None
        group.error = error
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        """Whether a queued or running request is left for :meth:`step`."""
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        """Run-level counters since this LLM was created."""
        bm = self.block_manager
        return EngineStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size,
            kv_cache_bytes=self.runner.kv_cache.num_bytes, peak_blocks_used=bm.peak_blocks_used,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_hit_blocks=bm.prefix_cache_hit_blocks, num_evictions=bm.num_evictions,
            num_preemptions=self.scheduler.num_preemptions, num_cow_copies=bm.num_cow_copies,
            num_prompt_tokens=self._num_prompt_tokens, num_generated_tokens=self._num_generated_tokens,
            num_prefill_tokens=self._num_prefill_tokens, num_steps=self._num_steps,
            physical_blocks=self._physical_blocks, logical_blocks=self._logical_blocks,
        )

    # ------------------------------------------------------------------ requests
    def _make_group(self, request: Request) -> SequenceGroup:
        params = request.params
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"request {request.request_id!r}: params must be SamplingParams or "
                            f"BeamSearchParams, got {type(params).__name__}")
        if isinstance(request.prompt, str):
            prompt_text: str | None = request.prompt
            token_ids = self.tokenizer(request.prompt)["input_ids"]
        else:
            prompt_text = None
            token_ids = [int(t) for t in request.prompt]
        self._arrivals += 1
        group = SequenceGroup(request.request_id, prompt_text, list(token_ids), params, self._arrivals)
        group.stats.num_prompt_tokens = len(token_ids)
        bad = [t for t in token_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            group.error = f"prompt token ids out of the vocabulary (0..{self.runner.vocab_size - 1}): {bad[:5]}"
            return group
        seq = Sequence(token_ids, index=0)
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
            checker = self._stop_string_checker(params) if params.stop else None
            group.beam_state = BeamSearchState(params, self.eos_token_ids, stop_checker=checker)
        self._num_prompt_tokens += len(token_ids)
        return group

    def structured_processor(self) -> Any:
        """The engine's :class:`batchgen.structured.StructuredOutputsProcessor`, shared by every
        constrained request (so its grammar cache and its batched mask fill are too); made on
        first use. Raises ImportError when xgrammar is missing."""
        if self._structured is None:
            from batchgen.structured import StructuredOutputsProcessor

            self._structured = StructuredOutputsProcessor(
                self.tokenizer, self.runner.vocab_size, self.eos_token_ids,
                max_threads=max(1, min(8, torch.get_num_threads())))
        return self._structured

    def _states(self, group: SequenceGroup, seq: Sequence) -> list[Any]:
        """``seq``'s processor states; built again from its tokens when it has none (after a
        preemption by recompute): fresh states that accept every generated token."""
        if seq.processor_states is None:
            states = [p.new_state(seq.prompt_token_ids, group.params) for p in group.processors]
            for token in seq.output_token_ids:
                for state in states:
                    state.accept_token(token)
            seq.processor_states = states
        return seq.processor_states

    def _stop_string_checker(self, params: BeamSearchParams) -> Callable[[Seq[int]], bool]:
        """For beams: does the decoded text of these tokens contain a stop string?"""
        def check(token_ids: Seq[int]) -> bool:
            text = self.tokenizer.decode(list(token_ids), skip_special_tokens=params.skip_special_tokens)
            return any(s in text for s in params.stop)
        return check

    def _stop_ids(self, params: SamplingParams | BeamSearchParams) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

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
        finished = [self._make_output(g) for g in plan.errored]
        if plan.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue cannot be admitted: fail it rather
                # than spin (add() already rejects what can never fit, so this is a guard).
                group = self.scheduler.waiting.popleft()
                group.error = "the request could not be scheduled with the whole KV cache free"
                finished.append(self._make_output(group))
            return finished, 0
        self._num_steps += 1
        sample = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in plan.scheduled]
        logits = self.runner.execute(plan.scheduled, sample, plan.copies)
        for seq, n in plan.scheduled:
            if n > 1 or seq.num_output_tokens == 0 or seq.num_computed_tokens + 1 < seq.num_tokens:
                self._num_prefill_tokens += n  # all but decodes: prompts, and recomputes
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        # Group the sampling sequences by request, keeping their logits rows.
        rows_by_group: dict[int, tuple[SequenceGroup, list[tuple[Sequence, int]]]] = {}
        seq_to_group = {id(s): g for g in self.scheduler.running for s in g.seqs}
        row = 0
        for (seq, _), samples in zip(plan.scheduled, sample):
            if samples:
                group = seq_to_group[id(seq)]
                rows_by_group.setdefault(id(group), (group, []))[1].append((seq, row))
                row += 1
        num_new = 0
        sampling_rows: list[SamplingRow] = []
        sampling_seqs: list[tuple[SequenceGroup, Sequence]] = []
        sampling_logit_rows: list[int] = []
        for group, entries in rows_by_group.values():
            if group.beam_state is not None:
                num_new += self._beam_step(group, entries, logits)
                continue
            if not group.forked:
                entries = self._fork_samples(group, entries)
            for seq, r in entries:
                sampling_rows.append(self._sampling_row(group, seq))
                sampling_seqs.append((group, seq))
                sampling_logit_rows.append(r)
        if sampling_rows:
            idx = torch.tensor(sampling_logit_rows, dtype=torch.long)
            result = self.sampler(logits.index_select(0, idx), sampling_rows)
            for i, (group, seq) in enumerate(sampling_seqs):
                top = result.top_logprobs[i] if result.top_logprobs else None
                self._append(group, seq, result.token_ids[i], result.logprobs[i], top)
                num_new += 1
        self._num_generated_tokens += num_new
        for group in list(self.scheduler.running):
            self._account_blocks(group)
            if group.is_finished:
                self.scheduler.finish_group(group)
                finished.append(self._make_output(group))
        return finished, num_new

    def _sampling_row(self, group: SequenceGroup, seq: Sequence) -> SamplingRow:
        params: SamplingParams = group.params
        suppress: Seq[int] = ()
        if seq.num_output_tokens < params.min_tokens:
            suppress = self._stop_ids(params)
        if not group.processors:
            return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids,
                               output_token_ids=seq.output_token_ids, generator=seq.generator,
                               suppress_token_ids=suppress)
        return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids, generator=seq.generator,
                           suppress_token_ids=suppress, processors=group.processors,
                           states=self._states(group, seq))

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

    def _append(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                top: dict[int, float] | None) -> None:
        """Append a sampled token and apply the stop rules of SamplingParams.

        A stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends the
        sequence without being emitted; the sampler never picks one before ``min_tokens``.
        """
        params: SamplingParams = group.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish_seq(seq, "stop", token if token in params.stop_token_ids else None)
            return
        seq.append_token(token, logprob)
        if seq.processor_states:
            for state in seq.processor_states:
                state.accept_token(token)
        if params.logprobs is not None and top is not None:
            seq.output_logprobs.append(top)
        new_text = seq.detokenizer.step(token)
        if params.stop and new_text and self._check_stop_strings(seq, params.stop, len(new_text)):
            return
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish_seq(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence, stops: list[str], num_new_chars: int) -> bool:
        text = seq.detokenizer.text
        longest = max(len(s) for s in stops)
        search_from = max(0, len(text) - num_new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            pos = text.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        seq.text = text[: best[0]]
        self._finish_seq(seq, "stop", best[1], text_fixed=True)
        return True

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason: str | int | None,
                    text_fixed: bool = False) -> None:
        """Mark ``seq`` finished, settle its text, and free its blocks at once."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not text_fixed:
            # The incremental text equals a full decode (tested); decoding once more at the
            # end is cheap and makes the returned text exact whatever the tokenizer.
            seq.text = self._full_text(seq)
        self.scheduler.free_seq(seq)

    def _full_text(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.detokenizer.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ beams
    def _beam_step(self, group: SequenceGroup, entries: list[tuple[Sequence, int]], logits: torch.Tensor) -> int:
        """One beam-search step: score all live beams with one top-k, keep the best
        ``beam_width``, fork survivors that have several children (sharing their blocks; only
        the partial last block is copied, on the next write), and free dead beams at once."""
        params: BeamSearchParams = group.params
        state: BeamSearchState = group.beam_state
        beams = [s for s, _ in entries]
        rows = torch.tensor([r for _, r in entries], dtype=torch.long)
        logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
        processed = bool(params.logits_processors)
        if processed:
            # As HF applies its processors in beam search: on the log-softmax scores, so that a
            # masked token drops out and the others keep their logprobs.
            outputs = [b.output_token_ids for b in beams]
            for proc in params.logits_processors:
                if not is_stateful(proc):
                    logprobs = proc(logprobs, outputs).float()
        if group.processors:
            processed = True
            apply_stateful(logprobs, [group.processors] * len(beams), [self._states(group, b) for b in beams])
        top_lp, top_ids = torch.topk(logprobs, min(state.num_candidates, logprobs.shape[-1]), dim=-1)
        candidates = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]
        if processed:  # only the continuations the processors allow are ranked
            candidates = [[(t, lp) for t, lp in c if lp != -math.inf] for c in candidates]
        chosen = state.step([b.output_token_ids for b in beams], [b.cumulative_logprob for b in beams], candidates)
        group.forked = True
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
                self.block_manager.fork(parent, seq)
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
                self.scheduler.free_seq(b)  # a dead beam: its blocks go back at once
        group.seqs = new_seqs
        if new_seqs and new_seqs[0].num_tokens < self.max_model_len:
            return len(new_seqs)
        # The search is over (or the context is full): settle the hypotheses.
        hyps = state.finalize([s.output_token_ids for s in new_seqs], [s.cumulative_logprob for s in new_seqs])
        for s in new_seqs:
            self.scheduler.free_seq(s)
        group.seqs = []
        for i, h in enumerate(hyps):
            ids = list(h.token_ids)
            if h.finish_token_id is not None:
                ids = ids[:-1]  # the stop token is not emitted
            done = Sequence(group.prompt_token_ids, index=i)
            done.token_ids.extend(ids)
            done.text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                              clean_up_tokenization_spaces=False)
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
            group.finished_seqs.append(done)
        return len(new_seqs)

    # ------------------------------------------------------------------ accounting & output
    def _account_blocks(self, group: SequenceGroup) -> None:
        live = [s for s in group.seqs if s.block_table]
        if not live:
            return
        logical = sum(len(s.block_table) for s in live)
        physical = len({b for s in live for b in s.block_table}) if len(live) > 1 else logical
        st = group.stats
        if logical > st.num_logical_blocks:
            st.num_logical_blocks = logical
            st.num_physical_blocks = max(st.num_physical_blocks, physical)
        elif physical > st.num_physical_blocks:
            st.num_physical_blocks = physical

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        out = RequestOutput(request_id=group.request_id, prompt=group.prompt,
                            prompt_token_ids=group.prompt_token_ids, error=group.error, stats=group.stats)
        if group.error is not None:
            self.scheduler.finish_group(group)
            return out
        params = group.params
        if isinstance(params, BeamSearchParams):
            for s in group.finished_seqs:
                out.outputs.append(CompletionOutput(
                    index=s.index, text=s.text, token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob, finish_reason=s.finish_reason,
                    score=s.score))
        else:
            seqs = sorted(group.seqs, key=lambda s: s.index)
            if params.best_of and params.best_of > params.n:
                def rank(s: Sequence) -> float:
                    if params.best_of_ranking == "mean":
                        return s.cumulative_logprob / max(1, s.num_output_tokens)
                    return s.cumulative_logprob
                seqs = sorted(seqs, key=rank, reverse=True)[: params.n]
            for i, s in enumerate(seqs):
                out.outputs.append(CompletionOutput(
                    index=i, text=s.text, token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        group.stats.num_generated_tokens = sum(len(o.token_ids) for o in out.outputs)
        self._physical_blocks += group.stats.num_physical_blocks
        self._logical_blocks += group.stats.num_logical_blocks
        return out
