"""LLM: the public Python API (vLLM's names): ``generate``, ``chat``, ``stream``; and
lm-eval's scoring requests, ``loglikelihood`` and ``loglikelihood_rolling``.

It loads the model and the tokenizer and drives an :class:`~batchgen.engine.core.EngineCore`
(the step loop) until every request has finished; outputs are built by the core's
:class:`~batchgen.engine.output_processor.OutputProcessor`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from batchgen.engine import loglikelihood as ll, prompts as prompt_forms
from batchgen.engine.config import EngineConfig
from batchgen.engine.core import EngineCore
from batchgen.engine.kv_cache import KVCache, num_blocks_for_budget
from batchgen.engine.model_loader import load_model
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import BeamSearchOutput, EngineStats, Request, RequestOutput
from batchgen.lora.request import LoRARequest, per_prompt
from batchgen.sampling.params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Params = SamplingParams | BeamSearchParams
PromptType = prompt_forms.PromptType
Conversation = list[dict[str, Any]]


def load_runner(config: EngineConfig) -> ModelRunner:
    """The model loaded and placed (:func:`~batchgen.engine.model_loader.load_model`), its KV
    cache sized to the budget and allocated, and the :class:`ModelRunner` over both."""
    loaded = load_model(config)
    shape = loaded.cache_shape
    num_blocks = num_blocks_for_budget(shape, loaded.device, config.kv_cache_memory,
                                       gpu_memory_utilization=config.gpu_memory_utilization)
    kv_cache = KVCache(shape, num_blocks, loaded.device)
    return ModelRunner(config, loaded, kv_cache)


class LLM:
    """Offline batch generation over a paged KV cache.

    ``LLM(config=EngineConfig(...))``, or the convenience ``LLM(model, dtype=..., ...)``: the
    keyword arguments are :class:`~batchgen.engine.config.EngineConfig`'s fields (see it for
    each setting) and build one; given both, the keywords override the config's fields.

    The engine's parts stay reachable for tools and tests: ``runner`` (model and KV cache),
    ``tokenizer``, ``block_manager``, ``scheduler``, ``sampler`` and ``engine`` (the core).

    Raises:
        ValueError: a setting out of range (see :class:`EngineConfig`).
        TypeError: a keyword that is no engine setting.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(model, **kwargs)
        elif model is not None or kwargs:
            config = EngineConfig.from_kwargs(**{**config.to_dict(), **kwargs, **({"model": model} if model else {})})
        self.config = config
        self.model_name = config.model
        self.runner = load_runner(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or self.runner.model_path,
                                                       trust_remote_code=config.trust_remote_code)
        self.engine = EngineCore(config, self.runner, self.tokenizer)
        self.block_manager = self.engine.block_manager
        self.scheduler = self.engine.scheduler
        self.sampler = self.engine.sampler
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_model_len = self.engine.max_model_len
        self.seed = config.seed
        window = self.block_manager.window
        logger.info("LLM ready: %s, %d KV blocks of %d tokens (%.1f MiB)%s, attention backend %s, "
                    "linear backend %s", config.model, self.runner.num_blocks, config.block_size,
                    self.runner.kv_cache.num_bytes / 2**20,
                    f", released behind every layer's {window}-token window" if window else "",
                    self.runner.attention_backend, self.runner.linear_backend)

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (vLLM's name; also :attr:`tokenizer`)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: Params | Seq[Params] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        *,
        on_tokens: Callable[[int], None] | None = None,
        params: Params | Seq[Params] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one RequestOutput per prompt, in input order (vLLM's
        ``LLM.generate``).

        ``prompts`` is one prompt or a list of them, each a string, a list of token ids,
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (see
        :mod:`batchgen.engine.prompts`); ``sampling_params`` (or ``params``) is one
        SamplingParams / BeamSearchParams for all, or one per prompt (None: SamplingParams()).
        ``use_tqdm`` shows a progress bar over the prompts (True, or a tqdm-like class).
        ``lora_request`` (with ``enable_lora``) is one LoRA adapter for all, or one (or None: the
        base model) per prompt; a bad adapter fails its prompts' outputs (``error``).

        Raises:
            ValueError: before anything runs, naming the prompt's index, for a prompt that can
                never run (empty, too long for ``max_model_len``, a token id or a stop token
                id outside the vocabulary, more logprobs than ``max_logprobs``) or a prompt
                key batchgen does not run.
            TypeError: a prompt that is none of the forms, or params of another type.
        """
        items = prompt_forms.as_list(prompts)
        params_list = prompt_forms.params_per_prompt(sampling_params, params, len(items))
        loras = per_prompt(lora_request, len(items))
        requests = [self._checked_request(i, p, sp) for i, (p, sp) in enumerate(zip(items, params_list))]
        for request, lora in zip(requests, loras):
            request.lora_request = lora
        return self._run_in_order(requests, on_tokens, use_tqdm)

    def _checked_request(self, index: int, prompt: Any, params: Params) -> Request:
        """The engine request of prompt ``index``; raises what :meth:`generate` says."""
        text, token_ids = prompt_forms.token_ids_of(prompt, index, self.tokenizer)
        error = prompt_forms.request_error(token_ids, params, self.runner.vocab_size, self.max_model_len,
                                           self.config.max_logprobs)
        if error is not None:
            raise ValueError(f"prompt {index}: {error}")
        form: Any = token_ids if text is None else {"prompt_token_ids": token_ids, "prompt": text}
        return Request(str(index), form, params)

    def _run_in_order(self, requests: list[Request], on_tokens: Callable[[int], None] | None,
                      use_tqdm: bool | Callable[..., Any] = False) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(requests))
        try:
            for out in self.stream(requests, on_tokens=on_tokens):
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[r.request_id] for r in requests]

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool | Callable[..., Any] = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt a :class:`BeamSearchOutput` whose
        ``sequences`` (best first) hold the prompt's and the beam's tokens, their text and the
        beam's cumulative logprob. It runs batchgen's in-engine beam search, so each sequence
        is the one ``generate(prompt, params)`` returns (HF's beam search semantics: see
        :class:`BeamSearchParams`). Raises as :meth:`generate` does."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes one BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [BeamSearchOutput.of(out, self.tokenizer, params.skip_special_tokens) for out in outputs]

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        sampling_params: Params | Seq[Params] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        on_tokens: Callable[[int], None] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's ``LLM.chat``.

        ``messages`` is one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or
        a list of them. Each is rendered with the tokenizer's chat template (or
        ``chat_template``), with the assistant's header when ``add_generation_prompt`` (or the
        last message left open when ``continue_final_message``); its token ids are exactly
        ``tokenizer.apply_chat_template(..., tokenize=True)``'s. Each output's ``prompt`` is the
        rendered text. One RequestOutput per conversation, in input order.

        Raises:
            ValueError: the tokenizer has no chat template and none is given, or a
                conversation is malformed (naming its index).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_name!r} has no chat template; "
                             "pass chat_template=... or use generate() on plain prompts")
        texts: list[str] = []
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not all(
                    isinstance(m, dict) and "role" in m for m in conversation):
                raise ValueError(f"conversation {i} must be a list of {{'role': ..., 'content': ...}} dicts")
            texts.append(self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs))
        # The template writes the special tokens itself: tokenise the text without adding any.
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        outputs = self.generate(ids, sampling_params, use_tqdm=use_tqdm, on_tokens=on_tokens,
                                lora_request=lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def loglikelihood(self, requests: Seq[ll.Pair], *, max_length: int | None = None,
                      truncate: bool = False,
                      lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[tuple[float, bool]]:
        """lm-eval's ``loglikelihood``: per ``(context, continuation)`` pair, the sum of the
        continuation's token logprobs given the context and whether every continuation token
        is the most likely one (``is_greedy``), in input order.

        Pairs are two texts (tokenised as lm-eval's ``hf`` model does: see
        :func:`batchgen.engine.loglikelihood.encode_pair`) or two token-id lists (an empty
        context stands for the BOS token, or EOS without one). All pairs run in one engine
        run: only the continuations' positions are scored, and a context shared by several
        pairs is computed once (prefix cache, or the same step's prefill).

        Args:
            max_length: the most tokens the model reads per pair (default and at most the
                model's length); a pair may have ``max_length + 1`` tokens, as its last token
                is only a target.
            truncate: drop a too-long pair's first context tokens (as lm-eval does) instead of
                refusing it.
            lora_request: a LoRA adapter for all pairs, or one (or None) per pair.

        Raises:
            ValueError: naming the request index: not a pair, an empty continuation, a pair
                too long for ``max_length`` (without ``truncate``), or an engine error.
        """
        pairs = ll.tokenize_pairs(self.tokenizer, requests, self.runner.vocab_size)
        return self._score_pairs(pairs, max_length, truncate, per_prompt(lora_request, len(pairs)))

    def loglikelihood_rolling(self, texts: PromptType | Seq[PromptType], *,
                              max_length: int | None = None,
                              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[float]:
        """lm-eval's ``loglikelihood_rolling``: per text (or token-id list, or prompt dict as
        :meth:`generate` takes; a single text or dict is one request, as in :meth:`generate`,
        but token ids always come in a list of requests, as lm-eval gives them), the sum
        of every token's logprob, scored in lm-eval's disjoint windows of ``max_length`` tokens
        (default: the model's length; see :func:`batchgen.engine.loglikelihood.rolling_windows`),
        the first token conditioned on the BOS (or EOS) token. Every window of every text runs
        in one engine run; each token is scored exactly once. A text of whitespace only is
        scored (its tokens), as in lm-eval. ``lora_request``: as :meth:`loglikelihood`'s, per text.

        Raises:
            ValueError: naming the request index: a text with no tokens (nothing to score),
                an id outside the vocabulary, or an engine error.
            TypeError: naming the request index: a request that is no text or id list.
        """
        max_length = self._scoring_length(max_length)
        items = prompt_forms.as_list(texts, ids_alone=False)
        loras = per_prompt(lora_request, len(items))
        window_loras: list[LoRARequest | None] = []
        prefix = ll.prefix_token_id(self.tokenizer)
        windows: list[tuple[list[int], list[int]]] = []
        counts: list[int] = []
        for i, text in enumerate(items):
            _, tokens = prompt_forms.token_ids_of(text, i, self.tokenizer,
                                                  lambda t: ll.encode(self.tokenizer, t), noun="request")
            if not tokens:
                raise ValueError(f"request {i}: the text is empty (it has no tokens to score)")
            bad = [t for t in tokens if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise ValueError(f"request {i}: token ids out of the vocabulary: {bad[:5]}")
            doc = ll.rolling_windows(tokens, prefix, max_length)
            windows.extend(doc)
            counts.append(len(doc))
            window_loras.extend([loras[len(counts) - 1]] * len(doc))
        scores = self._score_pairs(windows, max_length, False, window_loras)
        totals: list[float] = []
        start = 0
        for count in counts:
            totals.append(sum(lp for lp, _ in scores[start:start + count]))
            start += count
        return totals

    def _scoring_length(self, max_length: int | None) -> int:
        if max_length is None:
            return self.max_model_len
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= self.max_model_len:
            raise ValueError(f"max_length must be an integer in [1, {self.max_model_len}] (the model's "
                             f"length), got {max_length!r}")
        return max_length

    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]], max_length: int | None,
                     truncate: bool, loras: list[LoRARequest | None] | None = None) -> list[tuple[float, bool]]:
        max_length = self._scoring_length(max_length)
        requests = []
        for i, (context, continuation) in enumerate(pairs):
            fitted = ll.fit_window(context, continuation, max_length, truncate)
            if isinstance(fitted, str):
                raise ValueError(f"request {i}: {fitted}")
            requests.append(ll.to_request(str(i), *fitted))
            if loras and loras[i] is not None:
                requests[-1].lora_request = loras[i]
        results = {out.request_id: ll.loglikelihood_of(out) for out in self.stream(requests)}
        return [results[r.request_id] for r in requests]

    def stream(
        self,
        requests: Iterable[Request],
        on_tokens: Callable[[int], None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Run requests, yielding each RequestOutput as soon as its request finishes.

        ``requests`` is consumed lazily: only enough to keep the batch full is read ahead.
        ``on_tokens(n)`` is called once per step with the number of tokens generated in it.
        A request that fails (e.g. a prompt that can never fit, or a constraint that no token
        can satisfy) yields an output with ``error`` set; the others go on.
        """
        source = iter(requests)
        try:
            yield from self._run(source, self.scheduler.lookahead, on_tokens)
        finally:
            # The caller stopped early (an exception, Ctrl-C, or it closed the generator): drop
            # what this stream left behind so that the next stream starts clean.
            self.abort_all()

    def _run(self, source: Iterator[Request], lookahead: int,
             on_tokens: Callable[[int], None] | None) -> Iterator[RequestOutput]:
        exhausted = False
        engine = self.engine
        while True:
            while not exhausted and len(self.scheduler.waiting) < lookahead:
                try:
                    request = next(source)
                except StopIteration:
                    exhausted = True
                    break
                rejected = engine.add_request(request)
                if rejected is not None:
                    yield rejected
            if not engine.has_unfinished:
                if exhausted:
                    return
                continue
            finished, num_new = self.step()
            if on_tokens is not None and num_new:
                on_tokens(num_new)
            yield from finished

    def step(self) -> tuple[list[RequestOutput], int]:
        """Run one engine step; returns the requests that finished in it and the tokens
        generated (for callers that drive the loop themselves, with :meth:`add_request`)."""
        return self.engine.step()

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue one request for the next :meth:`step`; for callers that drive the step loop
        themselves (an executor's replica). Returns the request's error output at once when it
        can never run (e.g. its prompt cannot fit), else None."""
        return self.engine.add_request(request)

    def has_unfinished_requests(self) -> bool:
        """Whether a queued or running request is left for :meth:`step`."""
        return self.engine.has_unfinished

    def abort_all(self) -> int:
        """Drop every queued and running request, freeing their blocks; returns how many."""
        return self.engine.abort_all()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (as vLLM's method of the same name); False, changing
        nothing, while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def structured_processor(self) -> Any:
        """The engine's shared :class:`batchgen.structured.StructuredOutputsProcessor` (made on
        first use; ImportError when xgrammar is missing)."""
        return self.engine.structured_processor()

    def stats(self) -> EngineStats:
        """Run-level counters since this LLM was created."""
        return self.engine.stats()


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """A progress bar over ``total`` prompts, as vLLM's ``use_tqdm`` (True: tqdm's; a callable:
    that class), or None."""
    if use_tqdm is False or use_tqdm is None:
        return None
    if use_tqdm is True:
        use_tqdm = tqdm
    return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
