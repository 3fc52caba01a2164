"""Prompts: vLLM's prompt forms, read in one place, and what makes a prompt impossible to run.

Every entry point that takes prompts (``LLM.generate``, ``LLM.beam_search``,
``LLM.loglikelihood_rolling``, a :class:`~batchgen.engine.outputs.Request` given to
``LLM.stream``, and an OpenAI Batch completions line) reads them through :func:`as_list` and
:func:`parse`. A prompt is one of vLLM's ``PromptType`` forms that batchgen runs:

* a string (the text is tokenised with the model's tokenizer);
* a list of token ids;
* ``{"prompt": str}`` (vLLM's :class:`TextPrompt`);
* ``{"prompt_token_ids": [...]}`` (vLLM's :class:`TokensPrompt`; an optional ``"prompt"``
  beside the ids is the text the output reports, and is not tokenised).

A key of vLLM's that batchgen does not run (multi-modal data, prompt embeddings, an
encoder-decoder pair) is a ``ValueError`` naming the key and the prompt's index; a prompt of
another type is a ``TypeError`` naming its index and type.

:func:`request_error` says why a tokenised prompt (with its params) can never run: the one
rule that ``LLM.generate`` raises on before running anything, and that the engine turns into
the error of one request (a pipeline row) while the others go on.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

# typing's TypedDict learnt NotRequired in 3.11; pydantic requires typing_extensions
from typing_extensions import NotRequired, TypedDict

from batchgen.engine.prompt_logprobs import is_scoring_only
from batchgen.sampling.params import BeamSearchParams, SamplingParams

__all__ = ["TextPrompt", "TokensPrompt", "PromptType", "as_list", "parse", "token_ids_of",
           "request_error", "length_error", "params_per_prompt", "UNSUPPORTED_KEYS"]


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: a text, tokenised with the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: token ids, run as given; ``prompt`` (optional) is the text the
    output reports for them."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


#: What the prompt-taking methods accept per prompt.
PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

#: vLLM's prompt keys that batchgen does not run, and why (a text-only decoder engine).
UNSUPPORTED_KEYS: dict[str, str] = {
    "multi_modal_data": "batchgen runs text-only models",
    "mm_processor_kwargs": "batchgen runs text-only models",
    "multi_modal_uuids": "batchgen runs text-only models",
    "prompt_embeds": "batchgen takes text or token ids, not embeddings",
    "encoder_prompt": "batchgen runs decoder-only models (no encoder-decoder pairs)",
    "decoder_prompt": "batchgen runs decoder-only models (no encoder-decoder pairs)",
    "token_type_ids": "token type ids are for pooling models, which batchgen does not run",
    "cache_salt": "batchgen's prefix cache takes no salt",
}
_KEYS = ("prompt", "prompt_token_ids")


def as_list(prompts: Any, ids_alone: bool = True) -> list[Any]:
    """The prompts as a list: one prompt (a string, a dict, or with ``ids_alone`` a list of
    token ids) becomes a list of one; any other iterable is a list of prompts (an empty list
    is no prompt). Without ``ids_alone`` a list of ints is a list of prompts (each then
    refused by :func:`parse`), for calls whose requests are texts first (lm-eval's)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if ids_alone and isinstance(prompts, (list, tuple)) and prompts and _is_int(prompts[0]):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, int, float)):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def parse(prompt: Any, index: int, noun: str = "prompt") -> tuple[str | None, list[int] | None]:
    """``(text, token_ids)`` of one prompt: a text prompt gives ``(text, None)``, a token
    prompt ``(text or None, ids)``. Errors name ``f"{noun} {index}"``.

    Raises:
        ValueError: a dict with a key batchgen does not run, or with neither ``prompt`` nor
            ``prompt_token_ids``, naming the key and ``index``.
        TypeError: a prompt of another type (or ids that are not integers), naming ``index``.
    """
    where = f"{noun} {index}"
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt, where)
    if isinstance(prompt, (list, tuple)):
        return None, _ids(prompt, where, "")
    hint = " (a list of token ids is one request: put it in a list)" if _is_int(prompt) else ""
    raise TypeError(f"{where}: expected a string, a list of token ids, {{'prompt': str}} or "
                    f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}{hint}")


def _parse_dict(prompt: Mapping[Any, Any], where: str) -> tuple[str | None, list[int] | None]:
    for key in prompt:
        if key in UNSUPPORTED_KEYS:
            raise ValueError(f"{where}: {key!r} is not supported ({UNSUPPORTED_KEYS[key]})")
        if key not in _KEYS:
            raise ValueError(f"{where}: unknown prompt key {key!r}; a prompt dict takes "
                             "'prompt' (text) or 'prompt_token_ids' (token ids)")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{where}: 'prompt_token_ids' must be a list of token ids, "
                            f"got {type(ids).__name__}")
        return text, _ids(ids, where, "'prompt_token_ids' ")
    if text is None:
        raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or "
                         "'prompt_token_ids' (token ids)")
    return text, None


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _ids(values: Sequence[Any], where: str, what: str) -> list[int]:
    for value in values:
        if not _is_int(value):
            raise TypeError(f"{where}: {what}token ids must be integers, got "
                            f"{type(value).__name__} {value!r:.40}")
    return [operator.index(v) for v in values]


def token_ids_of(prompt: Any, index: int, tokenizer: Any,
                 encode: Callable[[str], list[int]] | None = None,
                 noun: str = "prompt") -> tuple[str | None, list[int]]:
    """``(text, token_ids)`` of one prompt (:func:`parse`), a text tokenised with
    ``tokenizer`` (its special-token default, as vLLM does) or with ``encode``."""
    text, ids = parse(prompt, index, noun)
    if ids is None:
        ids = list(encode(text) if encode is not None else tokenizer(text)["input_ids"])
    return text, ids


def length_error(num_tokens: int, params: Any, max_model_len: int) -> str | None:
    """Why a prompt of ``num_tokens`` cannot run in a context of ``max_model_len`` tokens: it
    is empty, or it leaves no room for a generated token (a scoring-only request reads all
    its tokens but the last)."""
    if num_tokens == 0:
        return "the prompt is empty"
    if is_scoring_only(params):
        if num_tokens > max_model_len + 1:
            return (f"the prompt has {num_tokens} tokens; the model scores at most "
                    f"{max_model_len + 1} (it reads {max_model_len}, and the last "
                    "token is only a target)")
    elif num_tokens >= max_model_len:
        return (f"the prompt has {num_tokens} tokens; the model takes at most "
                f"{max_model_len} (prompt plus at least one generated token)")
    return None


def request_error(token_ids: Sequence[int], params: Any, vocab_size: int, max_model_len: int,
                  max_logprobs: int) -> str | None:
    """Why a request can never run, or None: an empty or too long prompt, a prompt or stop
    token id outside the vocabulary, or more (prompt) logprobs than ``max_logprobs`` (-1: no
    cap)."""
    error = length_error(len(token_ids), params, max_model_len)
    if error is not None:
        return error
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"prompt token ids out of the vocabulary (0..{vocab_size - 1}): {bad[:5]}"
    bad = [t for t in getattr(params, "stop_token_ids", ()) if not 0 <= t < vocab_size]
    if bad:
        return f"stop_token_ids out of the vocabulary (0..{vocab_size - 1}): {bad[:5]}"
    if max_logprobs >= 0:
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name, None)
            if asked is not None and asked > max_logprobs:
                return (f"{name}={asked} is more than max_logprobs={max_logprobs} (an engine "
                        "setting: LLM(..., max_logprobs=N), engine.max_logprobs in a job)")
    return None


def params_per_prompt(sampling_params: Any, params: Any, num_prompts: int) -> list[Any]:
    """The params of each of ``num_prompts`` prompts: ``sampling_params`` (vLLM's keyword) or
    ``params`` (batchgen's earlier one), one for all or one per prompt (None: SamplingParams()).

    Raises:
        TypeError: both keywords, or params that are no SamplingParams / BeamSearchParams
            (naming their index).
        ValueError: a list of params of another length than the prompts.
    """
    if params is not None and sampling_params is not None:
        raise TypeError("give sampling_params or params, not both")
    given = params if params is not None else sampling_params
    if given is None:
        given = SamplingParams()
    if isinstance(given, (SamplingParams, BeamSearchParams)):
        return [given] * num_prompts
    if not isinstance(given, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams, a BeamSearchParams or a list of "
                        f"them, got {type(given).__name__}")
    if len(given) != num_prompts:
        raise ValueError(f"got {len(given)} params for {num_prompts} prompts; give one, or one per prompt")
    for i, p in enumerate(given):
        if not isinstance(p, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"sampling_params {i}: expected SamplingParams or BeamSearchParams, "
                            f"got {type(p).__name__}")
    return list(given)
