"""OpenAI Batch output lines: :func:`error_line` (an HTTP-style error answer), how a line is
read back (:func:`is_failed`, :func:`error_message`, :func:`response_key`), and
:class:`ResponseBuilder` (a finished request's ``ChatCompletion`` or ``Completion`` line, with
OpenAI's logprobs shapes).

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from batchgen.openai_batch.errors import DUPLICATE_CUSTOM_ID, MIN_LOGPROB, MODEL_NOT_FOUND
from batchgen.openai_batch.requests import BatchPrompt
from batchgen.io.protocols import PromptRecord


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def error_line(custom_id: str | None, message: str, param: str | None = None, code: str | None = None,
               status: int | None = None) -> dict[str, Any]:
    """An output line for a request that failed with an HTTP-style error (status 400, or 404 for an
    unknown model, unless given)."""
    if status is None:
        status = 404 if code == MODEL_NOT_FOUND else 400
    return {
        "id": _new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": _new_id("req_"),
            "body": {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        },
        "error": None,
    }


def is_failed(line: dict[str, Any]) -> bool:
    """True for an output line that holds no successful response: an ``error`` object at the top
    (OpenAI's error-file lines), or a response whose status is not 200 (``"error": null``)."""
    response = line.get("response") or {}
    return line.get("error") is not None or response.get("status_code") != 200


def error_message(line: dict[str, Any]) -> str | None:
    """Why an output line failed: the top ``error``'s message, else the response body's."""
    error = line.get("error")
    if error is None:
        body = (line.get("response") or {}).get("body")
        error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return None if error is None else str(error)


def response_key(line: dict[str, Any]) -> str | None:
    """The resume key of an output line: its custom_id, or None for a keyless or duplicate line."""
    body = (line.get("response") or {}).get("body") or {}
    if isinstance(body, dict) and (body.get("error") or {}).get("code") == DUPLICATE_CUSTOM_ID:
        return None
    value = line.get("custom_id")
    return None if value is None else str(value)


class _TokenText:
    """A token's text and its exact UTF-8 bytes, as OpenAI's logprobs show them (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            try:
                # deferred: transformers (~5 s) only for a byte-level tokenizer; the module stays torch-free
                from transformers.convert_slow_tokenizer import bytes_to_unicode
            except ImportError:  # pragma: no cover - the bytes then come from the decoded text
                pass
            else:
                self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        data = list(text.encode("utf-8"))
        if self._byte_of is not None:
            # A byte-level BPE token may hold part of a character: its bytes are exact, its text not.
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_of for c in piece):
                data = [self._byte_of[c] for c in piece]
        self._cache[token_id] = (text, data)
        return text, data


def _logprob(value: Any) -> float:
    """A logprob as OpenAI writes it (a prompt entry's ``Logprob`` or a float; -inf and NaN clipped)."""
    value = getattr(value, "logprob", value)
    return MIN_LOGPROB if value is None or value != value or value < MIN_LOGPROB else float(value)


class ResponseBuilder:
    """Builds the OpenAI output line of each finished request (``output.format: openai_batch``).

    Args:
        model: the model name written in every response body.
        tokenizer: for the token strings of logprobs.
        chat: for rows of a dataset (not of a batch file): answer as ``/v1/chat/completions``
            (True, when the chat template is applied) or ``/v1/completions``.
        top_logprobs: for rows of a dataset: alternatives per token to list (None: none).
    """

    # Reading back (see pipeline._BatchgenRecords, the other record kind).
    failed = staticmethod(is_failed)
    key = staticmethod(response_key)

    @staticmethod
    def output_tokens(line: dict[str, Any]) -> int:
        """The completion tokens of a line (``response.body.usage.completion_tokens``)."""
        body = (line.get("response") or {}).get("body")
        usage = body.get("usage") if isinstance(body, dict) else None
        return int((usage or {}).get("completion_tokens") or 0)

    @staticmethod
    def describe_error(line: dict[str, Any]) -> dict[str, Any]:
        """``{"custom_id", "error"}`` of a line, for the summary's ``first_error`` and messages."""
        return {"custom_id": line.get("custom_id"), "error": error_message(line)}

    def __init__(self, model: str, tokenizer: Any, *, chat: bool = True, top_logprobs: int | None = None) -> None:
        self.model = model
        self.chat = chat
        self.top_logprobs = top_logprobs
        self._token = _TokenText(tokenizer)

    def make(self, prompt: PromptRecord, output: Any | None) -> dict[str, Any]:
        """The output line of ``prompt``; ``output`` is the engine's RequestOutput, or None for a
        prompt that never reached the engine (then ``prompt.error`` is set)."""
        if isinstance(prompt, BatchPrompt):
            custom_id, endpoint, top = prompt.custom_id, prompt.endpoint, prompt.top_logprobs
        else:
            custom_id, endpoint, top = prompt.id, ("chat" if self.chat else "completion"), self.top_logprobs
        if prompt.error is not None or output is None:
            param, code = getattr(prompt, "error_param", None), getattr(prompt, "error_code", None)
            return error_line(custom_id, prompt.error or "the request was not run", param, code)
        if output.error is not None:
            return error_line(custom_id, output.error)
        beam = any(c.score is not None for c in output.outputs)
        if beam:  # best beam first, as the engine ranks them
            completions = sorted(output.outputs, key=lambda c: -c.score if c.score is not None else float("inf"))
        else:
            completions = sorted(output.outputs, key=lambda c: c.index)
        echo = self._echo(prompt, output) if getattr(prompt, "echo", False) else None
        choices = [self._choice(rank, c, endpoint, None if beam else top, echo) for rank, c in enumerate(completions)]
        stats = output.stats
        prompt_tokens = stats.num_prompt_tokens or len(output.prompt_token_ids or ())
        completion_tokens = stats.num_generated_tokens
        body: dict[str, Any] = {
            "id": _new_id("chatcmpl-" if endpoint == "chat" else "cmpl-"),
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": int(time.time()),
            "model": getattr(getattr(prompt, "lora_request", None), "lora_name", None) or self.model,  # its adapter
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.num_cached_tokens},
            },
            "system_fingerprint": None,
        }
        return {
            "id": _new_id("batch_req_"),
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _new_id("req_"), "body": body},
            "error": None,
        }

    def _echo(self, prompt: PromptRecord, output: Any) -> tuple[str, list[tuple[int, Any]]]:
        """The prompt's text and its ``(token id, logprob entry or None)`` positions, for ``echo``."""
        ids = list(output.prompt_token_ids or prompt.prompt_token_ids or ())
        text = prompt.prompt if prompt.prompt is not None else self._token.tokenizer.decode(ids)
        entries = list(output.prompt_logprobs or ()) or [None] * len(ids)
        return text, list(zip(ids, entries))

    def _choice(self, rank: int, completion: Any, endpoint: str | None, top: int | None,
                echo: tuple[str, list[tuple[int, Any]]] | None = None) -> dict[str, Any]:
        with_logprobs = top is not None and (completion.logprobs is not None or echo is not None)
        finish = completion.finish_reason or "length"
        if endpoint == "chat":
            return {
                "index": rank,
                "message": {"role": "assistant", "content": completion.text, "refusal": None},
                "logprobs": self._chat_logprobs(completion, top) if with_logprobs else None,
                "finish_reason": finish,
                "stop_reason": completion.stop_reason,
            }
        positions = list(zip(completion.token_ids, completion.logprobs or ()))
        text = completion.text
        if echo is not None:  # the prompt, then the completion, in the text and in the logprobs
            text, positions = echo[0] + text, echo[1] + positions
        return {
            "index": rank,
            "text": text,
            "logprobs": self._completion_logprobs(positions) if with_logprobs else None,
            "finish_reason": finish,
            "stop_reason": completion.stop_reason,
        }

    def _chat_logprobs(self, completion: Any, top: int | None) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            text, data = self._token(token_id)
            best = sorted(entry.items(), key=lambda kv: -_logprob(kv[1]))[: top or 0]
            alternatives = []
            for alt_id, alt_lp in best:
                alt_text, alt_data = self._token(alt_id)
                alternatives.append({"token": alt_text, "logprob": _logprob(alt_lp), "bytes": alt_data})
            content.append({"token": text, "logprob": _logprob(entry.get(token_id)), "bytes": data,
                            "top_logprobs": alternatives})
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, positions: list[tuple[int, Any]]) -> dict[str, Any]:
        """OpenAI's ``logprobs`` of a text completion over ``(token id, entry)`` positions: each
        lists its token and the best alternatives (up to logprobs + 1); an entry of None (the
        first prompt token of an echo: nothing predicts it) gives None in both lists."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in positions:
            text, _ = self._token(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_logprob(entry.get(token_id)))
            ranked = sorted(entry.items(), key=lambda kv: -_logprob(kv[1]))
            top_logprobs.append({self._token(t)[0]: _logprob(lp) for t, lp in ranked})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
