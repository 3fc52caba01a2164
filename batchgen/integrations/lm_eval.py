"""BatchgenLM: batchgen's engine as a model of lm-evaluation-harness (the model ``batchgen``).

Importing this module registers :class:`BatchgenLM` with lm-eval's model registry under the
name ``batchgen``, so that ``simple_evaluate(model="batchgen", model_args="pretrained=...")``
and ``batchgen lm-eval run --model batchgen ...`` find it; ``simple_evaluate(model=BatchgenLM(...))``
works as well. lm-eval is an extra (``pip install "batchgen[lm-eval]"``), imported here only.

The contract, request type by request type (lm-eval's ``Instance.args``):

- ``loglikelihood`` ``(context, continuation)``: tokenised exactly as lm-eval's ``hf`` model
  does (the whole string and the context are encoded, the continuation is the difference;
  trailing spaces of the context move to the continuation; an empty context becomes the
  prefix token). A pair longer than ``max_length + 1`` tokens loses tokens from the left, as
  ``hf`` does. Every pair of the call goes to :meth:`batchgen.LLM.loglikelihood` at once, so
  the choices of a question and a shared few-shot prefix are prefilled once (prefix cache).
- ``loglikelihood_rolling`` ``(text,)``: lm-eval's disjoint rolling windows of ``max_length``
  tokens after the prefix token (each token scored once), every window of every text in one
  engine call; the sum per text.
- ``generate_until`` ``(context, gen_kwargs)``: lm-eval's normalisation of ``gen_kwargs``
  (``max_gen_toks`` and its aliases, ``do_sample``/``temperature``); ``until`` plus the EOS
  text become stop strings; ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty`` and ``seed`` become :class:`batchgen.SamplingParams` fields (others
  are refused with a message naming them). The context is left-truncated to
  ``max_length - max_gen_toks`` tokens; the text is the decoded tokens cut at the first stop
  string, as ``hf`` returns it. All requests run in one engine call.

``model_args``: ``pretrained`` (an alias such as ``smollm2-135m-instruct`` or a model folder),
``max_length`` (the window; default the model's), ``max_gen_toks`` (default 256),
``add_bos_token``, ``device``, ``lora`` (or ``lora_local_path``, as lm-eval's ``vllm`` backend
spells it: a PEFT LoRA folder every request runs under; ``docs/lora.md``), and every
:class:`batchgen.engine.config.EngineConfig` setting, passed through with its default (``dtype``,
``block_size``, ``kv_cache_memory`` as bytes or ``"512MiB"``, ``num_threads``, ``seed``,
``max_num_batched_tokens``, ``max_model_len``...). lm-eval's ``batch_size`` and
``max_batch_size`` are accepted and ignored: the engine batches by its token budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter

try:
    import lm_eval.models  # noqa: F401  (fills the registry's built-in names before ours is added)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        'batchgen\'s lm-eval backend needs lm-evaluation-harness: pip install "batchgen[lm-eval]"'
    ) from exc

from batchgen.engine.config import MAX_LORA_RANK
from batchgen.engine.loglikelihood import encode, prefix_token_id
from batchgen.lora.request import LoRARequest
from batchgen.model_resolver import DEFAULT_MODEL
from batchgen.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
# gen_kwargs keys that map onto SamplingParams fields of the same name.
_SAMPLING_KEYS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed")
# gen_kwargs keys that HF's generate takes and that mean nothing different here.
_IGNORED_KEYS = ("num_beams", "use_cache")


def _byte_size(value: Any) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return int(TypeAdapter(ByteSize).validate_python(value))


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    """lm-eval's LM interface over one :class:`batchgen.LLM` (see the module docstring)."""

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        lora: str | None = None,
        lora_local_path: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``engine_kwargs`` are :class:`batchgen.engine.config.EngineConfig`'s settings, with
        its defaults (``kv_cache_memory`` may be a size such as ``"512MiB"``)."""
        super().__init__()
        # deferred: the engine and torch (~10 s) load with the model, not with the registration
        from batchgen.engine.llm import LLM

        self.lora_request = _lora_request(lora, lora_local_path, engine_kwargs)

        if device is not None and device.startswith("cuda"):
            # deferred: torch (~5 s) with the model, not with the registration
            import torch

            if not torch.cuda.is_available():
                logger.warning("device %r asked for, but CUDA is not available: running on the CPU", device)
                device = None
        if engine_kwargs.get("kv_cache_memory") is not None:
            engine_kwargs["kv_cache_memory"] = _byte_size(engine_kwargs["kv_cache_memory"])
        self.llm = LLM(pretrained, **({"device": device} if device else {}), **engine_kwargs)
        if self.lora_request is not None:
            error = self.llm.runner.register_lora(self.lora_request)  # a bad folder fails here, not per task
            if error is not None:
                raise ValueError(error)
        self.tokenizer = self.llm.tokenizer
        self.pretrained = pretrained
        self.add_bos_token = add_bos_token
        self.seed = self.llm.config.seed
        self._max_gen_toks = int(max_gen_toks)
        engine_len = int(self.llm.max_model_len)
        if max_length is not None and int(max_length) > engine_len:
            raise ValueError(f"max_length={max_length} is longer than the model's {engine_len} tokens")
        self._max_length = int(max_length) if max_length is not None else engine_len

    # ------------------------------------------------------------------ lm-eval's properties
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The ``hf`` model's encoding (:func:`batchgen.engine.loglikelihood.encode`), with
        ``add_bos_token`` as its default for ``add_special_tokens``."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        return encode(self.tokenizer, string, add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            return chat_template
        return self.tokenizer.chat_template

    # ------------------------------------------------------------------ the three request types
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score every ``(key, context ids, continuation ids)`` in one engine call; a pair past
        ``max_length + 1`` tokens loses context tokens from the left, as ``hf`` does."""
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        results = self.llm.loglikelihood(pairs, max_length=self.max_length, truncate=True,
                                         lora_request=self.lora_request)
        results = [(float(lp), bool(greedy)) for lp, greedy in results]
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """lm-eval's rolling windows of every text (encoded by :meth:`tok_encode`), all scored
        in one engine call (:meth:`batchgen.LLM.loglikelihood_rolling`)."""
        texts = [req.args[0] for req in requests]
        totals = self.llm.loglikelihood_rolling([self.tok_encode(t) for t in texts], max_length=self.max_length,
                                                lora_request=self.lora_request)
        totals = [float(t) for t in totals]
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for every ``(context, gen_kwargs)`` in one engine call."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts: list[list[int]] = []
        params = []
        stops: list[list[str]] = []
        for context, gen_kwargs in (req.args for req in requests):
            sp, until = self._sampling_params(gen_kwargs, eos)
            max_ctx = self.max_length - sp.max_tokens
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks={sp.max_tokens} leaves no room for a context in max_length={self.max_length}")
            prompts.append(self.tok_encode(context)[-max_ctx:])
            params.append(sp)
            stops.append(until)
        outputs = self.llm.generate(prompts, params, lora_request=self.lora_request) if prompts else []
        texts: list[str] = []
        for req, out, until in zip(requests, outputs, stops):
            if out.error:
                raise RuntimeError(f"generation failed for a request of task {req.task_name!r}: {out.error}")
            text = postprocess_generated_text(self.tok_decode(out.outputs[0].token_ids), until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _sampling_params(self, gen_kwargs: dict, eos: str) -> tuple[Any, list[str]]:
        """lm-eval's gen_kwargs -> (SamplingParams, the stop strings)."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_tokens = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        if not do_sample:
            temperature = 0.0
        fields = {key: kwargs.pop(key) for key in _SAMPLING_KEYS if key in kwargs}
        for key in _IGNORED_KEYS:
            kwargs.pop(key, None)
        kwargs.pop("max_length", None)
        if kwargs:
            raise ValueError(f"gen_kwargs {sorted(kwargs)} have no batchgen equivalent "
                             f"(known: until, max_gen_toks, do_sample, temperature, {', '.join(_SAMPLING_KEYS)})")
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=[s for s in until if s], **fields)
        return sp, until

    def get_model_info(self) -> dict:
        info = {"model": self.pretrained, "max_length": self.max_length}
        if self.lora_request is not None:
            info["lora"] = self.lora_request.lora_path
        return info


def _lora_request(lora: str | None, lora_local_path: str | None, engine_kwargs: dict[str, Any]) -> Any:
    """The LoRARequest of ``lora`` / ``lora_local_path`` (one of them, or both the same), with
    LoRA switched on in ``engine_kwargs``; None without either."""
    if lora and lora_local_path and lora != lora_local_path:
        raise ValueError(f"model_args give lora={lora!r} and lora_local_path={lora_local_path!r}; give one")
    path = lora or lora_local_path
    if not path:
        return None
    engine_kwargs["enable_lora"] = True
    engine_kwargs.setdefault("max_lora_rank", MAX_LORA_RANK)  # slots hold the adapter's own rank
    return LoRARequest(Path(path).name or "lora", 1, str(path))
