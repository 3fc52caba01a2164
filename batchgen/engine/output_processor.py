"""OutputProcessor: what happens to a token after it is chosen, and what a request returns.

For every sampled token it applies :class:`~batchgen.sampling.params.SamplingParams`' stop
rules (stop ids and EOS, stop strings, ``max_tokens``, the model's length), detokenises
incrementally, and settles a finished sequence's text; for every finished request it builds
the :class:`~batchgen.engine.outputs.RequestOutput` (``best_of`` ranking, logprobs, prompt
logprobs). The step loop (:mod:`batchgen.engine.core`) calls it; it holds no engine state
besides the tokenizer, the EOS ids, the context length and a way to free a finished
sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Any

from batchgen.engine import prompt_logprobs
from batchgen.engine.outputs import CompletionOutput, RequestOutput
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.sampling.params import BeamSearchParams, SamplingParams


class OutputProcessor:
    """Stop rules, detokenisation and the building of :class:`RequestOutput`.

    Args:
        tokenizer: the engine's HF tokenizer.
        eos_token_ids: the model's EOS ids (a stop unless ``ignore_eos``).
        max_model_len: a sequence stops with ``"length"`` when it holds this many tokens.
        free_seq: called with a sequence as soon as it finishes (frees its blocks).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int,
                 free_seq: Callable[[Sequence], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.free_seq = free_seq

    def stop_ids(self, params: SamplingParams | BeamSearchParams) -> list[int]:
        """The token ids that end a sequence: ``stop_token_ids``, and EOS unless ``ignore_eos``."""
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def stop_string_checker(self, params: BeamSearchParams) -> Callable[[Seq[int]], bool]:
        """For beams: does the decoded text of these tokens contain a stop string?"""
        def check(token_ids: Seq[int]) -> bool:
            text = self.tokenizer.decode(list(token_ids), skip_special_tokens=params.skip_special_tokens)
            return any(s in text for s in params.stop)
        return check

    # ------------------------------------------------------------------ per token
    def append(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
               top: dict[int, float] | None) -> None:
        """Append a sampled token and apply the stop rules of SamplingParams.

        A stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends the
        sequence without being emitted; the sampler never picks one before ``min_tokens``.
        """
        params: SamplingParams = group.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self.finish_seq(seq, "stop", token if token in params.stop_token_ids else None)
            return
        seq.append_token(token, logprob)
        if seq.processor_states:
            for state in seq.processor_states:
                state.accept_token(token)
        if params.logprobs is not None and top is not None:
            seq.output_logprobs.append(top)
        new_text = seq.detokenizer.step(token)
        if params.stop and new_text and self._check_stop_strings(seq, params, len(new_text)):
            return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            self.finish_seq(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence, params: SamplingParams, num_new_chars: int) -> bool:
        stops = params.stop
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
        seq.text = text[: best[0] + len(best[1]) if params.include_stop_str_in_output else best[0]]
        self.finish_seq(seq, "stop", best[1], text_fixed=True)
        return True

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: str | int | None,
                   text_fixed: bool = False) -> None:
        """Mark ``seq`` finished, settle its text, and free its blocks at once."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not text_fixed:
            # The incremental text equals a full decode (tested); decoding once more at the
            # end is cheap and makes the returned text exact whatever the tokenizer.
            seq.text = self.decode(seq.output_token_ids, seq.detokenizer.skip_special_tokens)
        self.free_seq(seq)

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """The text of ``token_ids``, decoded in one go (no clean-up of spaces)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ per request
    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The finished (or failed) request's :class:`RequestOutput`; sets
        ``group.stats.num_generated_tokens``."""
        out = RequestOutput(request_id=group.request_id, prompt=group.prompt,
                            prompt_token_ids=group.prompt_token_ids, error=group.error, stats=group.stats)
        if group.error is not None:
            return out
        out.prompt_logprobs = prompt_logprobs.build(group, self.tokenizer)
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
                    index=i, text=s.text if params.detokenize else "", token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        group.stats.num_generated_tokens = sum(len(o.token_ids) for o in out.outputs)
        return out
