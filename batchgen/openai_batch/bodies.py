"""The bodies of OpenAI Batch request lines: their schemas (OpenAI's fields and vLLM's extra
ones), the fields accepted only with their no-op value, chat messages, and ``response_format``
as structured outputs. Each check raises :class:`~batchgen.openai_batch.errors.LineError`
worded as OpenAI words it.

This module imports neither torch nor the engine (its parameter classes are torch-free; the
grammar library is imported when a ``response_format`` is checked).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from batchgen.openai_batch.errors import LineError
from batchgen.sampling.params import StructuredOutputsParams
from batchgen.structured import check, satisfiable
from batchgen.suggest import did_you_mean


class Body(BaseModel):
    """Fields both endpoints take. Types are strict: ``"n": "2"`` is an error, not 2."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # Accepted and without effect on what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted only with their no-op value (see UNSUPPORTED).
    stream: bool | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None


class ChatBody(Body):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


def _off(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


# Fields accepted only when they ask for nothing batchgen cannot do: field -> (is it a no-op?, why not).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_off, "a batch line is answered whole; drop 'stream'"),
    "logit_bias": (_off, "'logit_bias' is not supported"),
    "tools": (_off, "tool calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported"),
    "functions": (_off, "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the 'text' modality is supported"),
    "audio": (_off, "audio output is not supported"),
    "prediction": (_off, "predicted outputs are not supported"),
    "reasoning_effort": (_off, "'reasoning_effort' is not supported"),
    "web_search_options": (_off, "web search is not supported"),
    "verbosity": (_off, "'verbosity' is not supported"),
    "add_generation_prompt": (lambda v: v in (None, True), "'add_generation_prompt: false' is not supported"),
    "continue_final_message": (_off, "'continue_final_message' is not supported"),
    "chat_template_kwargs": (_off, "'chat_template_kwargs' is not supported"),
    "suffix": (_off, "'suffix' is not supported"),
}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_FIELDS = {"role", "content", "name", "refusal"}


def structured_outputs_of(response_format: dict[str, Any] | None) -> Any:
    """``response_format`` as structured outputs: None for free text; a 400 when it cannot be honoured."""
    if response_format is None or response_format.get("type") == "text":
        return None
    result = _constraint_of(json.dumps(response_format, sort_keys=True))
    if isinstance(result, LineError):
        raise result
    return result


@functools.lru_cache(maxsize=256)
def _constraint_of(text: str) -> Any:
    """The constraint of one ``response_format`` (JSON text), checked once however many lines
    share it: a StructuredOutputsParams, or the LineError to answer with."""
    response_format = json.loads(text)
    kind = response_format.get("type")
    if kind not in ("json_object", "json_schema"):
        return LineError(f"Invalid value for 'response_format.type': {json.dumps(kind)}; expected 'text', "
                         "'json_object' or 'json_schema'.", "response_format.type", "invalid_value")
    where = "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    spec = response_format.get("json_schema")
    if kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
        return LineError(f"'{where}' must be a JSON schema object.", where, "invalid_value")
    try:
        params = (StructuredOutputsParams(json_object=True) if kind == "json_object"
                  else StructuredOutputsParams(json=spec["schema"]))
    except ValueError as exc:
        return LineError(str(exc), where, "invalid_value")
    try:
        check(params)  # the schema compiles, and the grammar library is installed
    except ImportError as exc:
        return LineError(str(exc), "response_format", "unsupported_value")
    except ValueError as exc:
        return LineError(str(exc), where, "invalid_value")
    if satisfiable(params) is False:
        return LineError(f"'{where}' can never be matched: it compiles, but it allows no text at all.", where,
                         "invalid_value")
    return params


def validation_error(exc: ValidationError, fields: Iterable[str]) -> LineError:
    """The problem pydantic found, worded as OpenAI words it: every unknown field at once, else
    the first other problem."""
    errors = exc.errors()
    unknown = [[str(p) for p in e["loc"]] for e in errors if e["type"] == "extra_forbidden" and e["loc"]]
    if unknown:
        return unrecognized([u[-1] for u in unknown], fields, ".".join(unknown[0]), "request argument")
    err = errors[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    param = ".".join(loc) or None
    if err["type"] == "missing":
        return LineError(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    value = err.get("input")
    shown = json.dumps(value)[:80] if not isinstance(value, (dict, list)) else type(value).__name__
    return LineError(f"Invalid value for '{param}': {err['msg'].lower()} (got {shown}).", param, "invalid_type")


def unrecognized(names: list[str], fields: Iterable[str], param: str | None, noun: str, where: str = "") -> LineError:
    """``Unrecognized request arguments supplied: a (did you mean 'b'?), c``: every unknown name."""
    fields = list(fields)
    listed = ", ".join(f"{name}{did_you_mean(name, fields)}" for name in names)
    plural = "s" if len(names) > 1 else ""
    return LineError(f"Unrecognized {noun}{plural}{where} supplied: {listed}", param, "unknown_parameter")


def chat_messages(raw: list[Any]) -> list[dict[str, str]]:
    """Check chat messages and flatten text-part content into one string per message."""
    if not raw:
        raise LineError("'messages' must hold at least one message.", "messages", "invalid_value")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise LineError(f"Invalid value for '{where}': expected an object.", where, "invalid_type")
        unknown = sorted(set(message) - MESSAGE_FIELDS)
        if "tool_calls" in unknown or message.get("role") in ("tool", "function"):
            raise LineError("tool calling is not supported", where, "unsupported_value")
        if unknown:
            raise unrecognized(unknown, MESSAGE_FIELDS, f"{where}.{unknown[0]}", "argument", f" in '{where}'")
        role = message.get("role")
        if role not in _ROLES:
            raise LineError(f"Invalid value for '{where}.role': {json.dumps(role)}; expected one of "
                            "'system', 'developer', 'user', 'assistant'.", f"{where}.role", "invalid_value")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise LineError(f"content part of type {json.dumps(kind)} is not supported: this model "
                                    "takes text parts only", f"{where}.content.{j}", "unsupported_value")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise LineError(f"Invalid value for '{where}.content': expected a string or a list of text parts.",
                            f"{where}.content", "invalid_type")
        entry = {"role": _ROLES[role], "content": content}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        messages.append(entry)
    return messages
