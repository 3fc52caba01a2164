"""OpenAI Batch API files: input lines become engine requests, results become OpenAI lines.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``, through the model's chat template) or
``/v1/completions`` (``body.prompt``: text or token ids). Each line carries its own generation
parameters (OpenAI's fields and vLLM's extra ones, see docs/openai-batch.md). An output line is
``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`` whose body is a ``ChatCompletion`` or a ``Completion`` with ``usage``.

Contract:

* The input is streamed line by line, never loaded whole. The custom_ids seen in it and those
  already answered in the output live in a private temporary SQLite database, so memory stays
  flat whatever the file's length.
* A line that cannot run never raises and never stops the others: invalid JSON, no usable
  ``custom_id``, a duplicate ``custom_id``, an unknown url, an invalid, unknown or unsupported
  body field, a prompt that does not fit, or an engine error for that request each give one
  output line with status 400 (404 for a ``model`` this job does not serve) and an OpenAI error
  body (``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``).
* Unknown body fields are rejected, as OpenAI does ("Unrecognized request argument"), rather
  than ignored as vLLM does: a misspelt parameter never silently changes what is generated.
* Resume: an output line answers its ``custom_id``. Lines without a usable ``custom_id`` and
  duplicates are written as soon as they are read, so they are answered in input order: on
  resume the first ``k`` of them are skipped, ``k`` being how many such lines the output holds
  (their key is None, see :func:`response_key`). Every line is therefore answered exactly once
  across any number of kills and resumes, provided the input file is the same.

This module imports neither torch nor the engine (their parameter classes are torch-free).
"""

from __future__ import annotations

import functools
import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from batchgen.config import ConfigError, ConfigIssue, PromptSection, RunConfig
from batchgen.run.dataset import DataError, PromptBuilder, PromptRecord, resolve_source
from batchgen.run.writer import read_records
from batchgen.sampling.params import BeamSearchParams, SamplingParams
from batchgen.suggest import did_you_mean

__all__ = [
    "BatchFile",
    "BatchPrompt",
    "LineParser",
    "ResponseBuilder",
    "ResumeIndex",
    "error_line",
    "error_message",
    "is_failed",
    "open_input",
    "response_key",
]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS: dict[str, Literal["chat", "completion"]] = {CHAT_URL: "chat", COMPLETIONS_URL: "completion"}
LINE_FIELDS = ("custom_id", "method", "url", "body")

#: OpenAI error codes written by this module (``body.error.code``).
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MODEL_NOT_FOUND = "model_not_found"  # status 404, as OpenAI and vLLM answer it; every other error is a 400

#: OpenAI reports an impossible token's logprob as this instead of -inf.
MIN_LOGPROB = -9999.0
#: Most alternatives per token (vLLM's default ``max_logprobs``; OpenAI's chat allows 20).
MAX_TOP_LOGPROBS = 20


# --------------------------------------------------------------------------- input records


@dataclass
class BatchPrompt(PromptRecord):
    """One line of an OpenAI batch file on its way to the engine.

    ``id`` is the ``custom_id`` for a line that may run or be resumed, None for a line without a
    usable ``custom_id`` or a duplicate (their resume key). ``custom_id`` is what the output line
    echoes. ``endpoint`` is ``"chat"`` or ``"completion"``; ``top_logprobs`` the alternatives
    per token the response lists (None: no logprobs). ``error_param`` and ``error_code`` go with
    ``error`` into the OpenAI error body.
    """

    custom_id: str | None = None
    endpoint: Literal["chat", "completion"] | None = None
    top_logprobs: int | None = None
    error_param: str | None = None
    error_code: str | None = None


class LineError(Exception):
    """Why one line cannot run: becomes its status-400 output line."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# --------------------------------------------------------------------------- body schemas


class _Body(BaseModel):
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
    # Accepted only with their no-op value (see _UNSUPPORTED).
    stream: bool | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None


class _ChatBody(_Body):
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


class _CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


def _off(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


# Fields accepted only when they ask for nothing batchgen cannot do: field -> (is it a no-op?, why not).
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_off, "a batch line is answered whole; drop 'stream'"),
    "logit_bias": (_off, "'logit_bias' is not supported"),
    "include_stop_str_in_output": (_off, "'include_stop_str_in_output' is not supported: stop strings are never included"),
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
    "echo": (_off, "'echo' is not supported"),
    "suffix": (_off, "'suffix' is not supported"),
}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_FIELDS = {"role", "content", "name", "refusal"}


def _structured_outputs_type() -> Any:
    """The engine's ``StructuredOutputsParams`` when this batchgen has structured outputs, else None."""
    import dataclasses

    try:
        from batchgen.sampling.params import StructuredOutputsParams  # type: ignore[attr-defined]
    except ImportError:
        return None
    names = {f.name for f in dataclasses.fields(SamplingParams)} & {f.name for f in dataclasses.fields(BeamSearchParams)}
    return StructuredOutputsParams if "structured_outputs" in names else None


def _constraint(response_format: dict[str, Any] | None) -> Any:
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
    structured = _structured_outputs_type()
    if structured is None:
        return LineError(f"response_format {{'type': '{kind}'}} needs structured outputs, which this version "
                         "of batchgen does not have; drop 'response_format' to generate free text",
                         "response_format", "unsupported_value")
    where = "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    spec = response_format.get("json_schema")
    if kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
        return LineError(f"'{where}' must be a JSON schema object.", where, "invalid_value")
    try:
        params = structured(json_object=True) if kind == "json_object" else structured(json=spec["schema"])
    except ValueError as exc:
        return LineError(str(exc), where, "invalid_value")
    try:
        from batchgen.structured import check  # type: ignore[import-not-found]
    except ImportError:  # no up-front check: the engine reports a bad constraint for this line
        return params
    try:
        check(params)  # the schema compiles, and the grammar library is installed
    except ImportError as exc:
        return LineError(str(exc), "response_format", "unsupported_value")
    except ValueError as exc:
        return LineError(str(exc), where, "invalid_value")
    return params


def _validation_error(exc: ValidationError, fields: Iterable[str]) -> LineError:
    """The first problem pydantic found, worded as OpenAI words it."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden" and loc:
        return LineError(
            f"Unrecognized request argument supplied: {loc[-1]}{did_you_mean(loc[-1], fields)}",
            param, "unknown_parameter",
        )
    if err["type"] == "missing":
        return LineError(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    value = err.get("input")
    shown = json.dumps(value)[:80] if not isinstance(value, (dict, list)) else type(value).__name__
    return LineError(f"Invalid value for '{param}': {err['msg'].lower()} (got {shown}).", param, "invalid_type")


def _messages(raw: list[Any]) -> list[dict[str, str]]:
    """Check chat messages and flatten text-part content into one string per message."""
    if not raw:
        raise LineError("'messages' must hold at least one message.", "messages", "invalid_value")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise LineError(f"Invalid value for '{where}': expected an object.", where, "invalid_type")
        unknown = sorted(set(message) - _MESSAGE_FIELDS)
        if "tool_calls" in unknown or message.get("role") in ("tool", "function"):
            raise LineError("tool calling is not supported", where, "unsupported_value")
        if unknown:
            raise LineError(f"Unrecognized argument in '{where}': {unknown[0]}", f"{where}.{unknown[0]}",
                            "unknown_parameter")
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


# --------------------------------------------------------------------------- line -> request


class LineParser:
    """Turns one parsed input line into a :class:`BatchPrompt` with its own engine params.

    Args:
        tokenizer: the model's HF tokenizer (chat template, tokens, prompt lengths).
        max_model_len: the model's context length.
        model_names: what a line's ``model`` may say (the job's model and its aliases); a line
            without ``model`` is accepted.
        logits_processors: the job's sampler plugin processors, added to every sampled line.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        model_names: Iterable[str],
        logits_processors: Iterable[Any] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_names = list(dict.fromkeys(model_names))
        self.logits_processors = list(logits_processors)
        # The builders render and tokenize; the length check is this class's (it knows max_tokens).
        self._chat = PromptBuilder(PromptSection(), tokenizer)
        self._plain = PromptBuilder(PromptSection(chat_template=False), tokenizer)

    def parse(self, line: dict[str, Any], custom_id: str, index: int) -> BatchPrompt:
        """The request of a line whose ``custom_id`` is known; problems land in ``error``."""
        prompt = BatchPrompt(id=custom_id, index=index, row=line, custom_id=custom_id)
        try:
            self._fill(prompt, line)
        except LineError as exc:
            prompt.error, prompt.error_param, prompt.error_code = exc.message, exc.param, exc.code
            prompt.params = None
        return prompt

    def _fill(self, prompt: BatchPrompt, line: dict[str, Any]) -> None:
        unknown = sorted(set(line) - set(LINE_FIELDS))
        if unknown:
            raise LineError(f"Unrecognized field in the request line: {unknown[0]}; a line holds "
                            "'custom_id', 'method', 'url' and 'body'.", unknown[0], "unknown_parameter")
        if line.get("method") != "POST":
            raise LineError(f"Invalid 'method': {json.dumps(line.get('method'))}; only 'POST' is supported.",
                            "method", "invalid_value")
        url = line.get("url")
        endpoint = ENDPOINTS.get(url) if isinstance(url, str) else None
        if endpoint is None:
            raise LineError(f"Invalid 'url': {json.dumps(url)}; supported: '{CHAT_URL}' and '{COMPLETIONS_URL}'.",
                            "url", "invalid_url")
        prompt.endpoint = endpoint
        body = line.get("body")
        if not isinstance(body, dict):
            raise LineError("'body' must be a JSON object.", "body", "invalid_type")
        schema = _ChatBody if endpoint == "chat" else _CompletionBody
        try:
            parsed = schema.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc, schema.model_fields) from None
        self._check_model(parsed.model)
        for name, (is_off, why) in _UNSUPPORTED.items():
            if name in parsed.model_fields_set and not is_off(getattr(parsed, name)):
                raise LineError(why, name, "unsupported_parameter")
        constraint = _constraint(parsed.response_format)
        if isinstance(parsed, _ChatBody):
            if not self._chat.use_chat:
                raise LineError(f"this model has no chat template; send '{COMPLETIONS_URL}' lines", "url",
                                "unsupported_value")
            record = self._chat.build(prompt.id or "", prompt.index, {"prompt": _messages(parsed.messages)})
            where = "messages"
        else:
            record = self._completion_record(parsed.prompt, prompt)
            where = "prompt"
        if record.error is not None:
            raise LineError(record.error, where, "invalid_value")
        prompt.prompt, prompt.prompt_token_ids = record.prompt, record.prompt_token_ids
        num_prompt = len(record.prompt_token_ids or ())
        prompt.params = self._params(parsed, num_prompt, where, constraint)
        prompt.top_logprobs = self._top_logprobs(parsed)

    def _check_model(self, model: str | None) -> None:
        if model is None or model in self.model_names:
            return
        served = self.model_names[0]
        raise LineError(
            f"The model '{model}' is not served by this job, which runs '{served}'; map it with "
            f"--model {model}={served} (or list it in model.aliases).",
            "model", MODEL_NOT_FOUND,
        )

    def _completion_record(self, value: Any, prompt: BatchPrompt) -> PromptRecord:
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) != 1:
                raise LineError(f"'prompt' holds {len(value)} prompts; give one prompt per line.",
                                "prompt", "invalid_value")
            value = value[0]
        if isinstance(value, str):
            return self._plain.build(prompt.id or "", prompt.index, {"prompt": value})
        if not value:
            raise LineError("'prompt' is empty.", "prompt", "invalid_value")
        if any(t < 0 for t in value):
            raise LineError("'prompt' token ids must be >= 0.", "prompt", "invalid_value")
        return PromptRecord(id=prompt.id or "", index=prompt.index, row={}, prompt=None, prompt_token_ids=list(value))

    def _max_tokens(self, body: _ChatBody | _CompletionBody, num_prompt: int, where: str) -> int:
        requested = body.max_tokens
        if isinstance(body, _ChatBody) and body.max_completion_tokens is not None:
            if requested is not None and requested != body.max_completion_tokens:
                raise LineError("give one of 'max_tokens' and 'max_completion_tokens', not both",
                                "max_completion_tokens", "invalid_value")
            requested = body.max_completion_tokens
        if requested is not None and requested < 1:
            raise LineError(f"Invalid 'max_tokens': {requested}; it must be >= 1.", "max_tokens", "invalid_value")
        if requested is None:
            # OpenAI's defaults: 16 for completions, the rest of the context for chat.
            requested = 16 if isinstance(body, _CompletionBody) else max(self.max_model_len - num_prompt, 0)
        if requested < 1 or num_prompt + requested > self.max_model_len:
            raise LineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the {where}, {requested} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                where, CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def _params(self, body: _ChatBody | _CompletionBody, num_prompt: int, where: str, constraint: Any = None) -> Any:
        max_tokens = self._max_tokens(body, num_prompt, where)
        n = 1 if body.n is None else body.n
        common: dict[str, Any] = {} if constraint is None else {"structured_outputs": constraint}
        common.update(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=bool(body.ignore_eos),
            skip_special_tokens=True if body.skip_special_tokens is None else body.skip_special_tokens,
        )
        try:
            if body.use_beam_search:
                self._check_beam_fields(body)
                length_penalty = 1.0 if body.length_penalty is None else body.length_penalty
                return BeamSearchParams(beam_width=n, length_penalty=length_penalty, **common)
            if body.length_penalty not in (None, 1.0):
                raise LineError("'length_penalty' applies with 'use_beam_search: true'", "length_penalty",
                                "invalid_value")
            logprobs = self._engine_logprobs(body)
            return SamplingParams(
                n=n,
                best_of=getattr(body, "best_of", None),
                # OpenAI's defaults: temperature 1 and top_p 1 (sampling; 0 means greedy).
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed,
                logprobs=logprobs,
                logits_processors=list(self.logits_processors),
                **common,
            )
        except ValueError as exc:
            message = str(exc)
            name = message.split(" ", 1)[0]
            param = name if name in type(body).model_fields else None
            raise LineError(message, param, "invalid_value") from None

    @staticmethod
    def _check_beam_fields(body: _ChatBody | _CompletionBody) -> None:
        """Beam search ranks raw log-probabilities: sampling-only fields would be ignored, so refuse them.

        ``temperature`` and ``seed`` are accepted and change nothing (as in vLLM).
        """
        defaults: dict[str, tuple[Any, ...]] = {
            "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,),
            "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logprobs": (), "top_logprobs": (),
        }
        for name, allowed in defaults.items():
            value = getattr(body, name, None)
            if value is not None and value is not False and value not in allowed:
                raise LineError(f"'{name}' is not supported with 'use_beam_search'", name, "unsupported_parameter")
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of != (body.n or 1):
            raise LineError("'best_of' is not supported with 'use_beam_search'; 'n' sets the beam width",
                            "best_of", "unsupported_parameter")

    @staticmethod
    def _engine_logprobs(body: _ChatBody | _CompletionBody) -> int | None:
        """The engine's ``logprobs`` (alternatives besides the chosen token), or None."""
        if isinstance(body, _ChatBody):
            if body.top_logprobs is not None and not body.logprobs:
                raise LineError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
            if not body.logprobs:
                return None
            value, name = body.top_logprobs or 0, "top_logprobs"
        else:
            if body.logprobs is None:
                return None
            value, name = body.logprobs, "logprobs"
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise LineError(f"Invalid '{name}': {value}; it must be between 0 and {MAX_TOP_LOGPROBS}.", name,
                            "invalid_value")
        return value

    @staticmethod
    def _top_logprobs(body: _ChatBody | _CompletionBody) -> int | None:
        if isinstance(body, _ChatBody):
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs


# --------------------------------------------------------------------------- the file and resume


class ResumeIndex:
    """What a previous run already answered, kept on disk (see the module's resume contract).

    ``answered`` custom_ids sit in a temporary SQLite table; ``keyless`` counts the answered
    lines whose key is None (no usable custom_id, or a duplicate).
    """

    def __init__(self) -> None:
        # "" opens a private temporary database on disk: its pages spill to a file, not to RAM.
        self._db = sqlite3.connect("")
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE answered (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")
        self.num_answered = 0
        self.keyless = 0

    def load(self, path: str | Path, key: Callable[[dict[str, Any]], str | None]) -> None:
        """Add the answers in the output file ``path`` (already repaired by ``prepare_output``)."""
        if not Path(path).exists():
            return
        for record in read_records(path):
            value = key(record)
            if value is None:
                self.keyless += 1
            else:
                self.num_answered += self._db.execute("INSERT OR IGNORE INTO answered VALUES (?)", (value,)).rowcount

    def __len__(self) -> int:
        return self.num_answered + self.keyless

    def __contains__(self, custom_id: object) -> bool:
        if not self.num_answered:
            return False
        return self._db.execute("SELECT 1 FROM answered WHERE id = ?", (custom_id,)).fetchone() is not None

    def first_line(self, custom_id: str, line: int) -> int | None:
        """Record that ``custom_id`` was read on ``line``; return the line it was first read on
        if this is a repeat, else None."""
        if self._db.execute("INSERT OR IGNORE INTO seen VALUES (?, ?)", (custom_id, line)).rowcount:
            return None
        return self._db.execute("SELECT line FROM seen WHERE id = ?", (custom_id,)).fetchone()[0]

    def close(self) -> None:
        self._db.close()


class BatchFile:
    """An OpenAI batch input file, read lazily (``data.format: openai_batch``).

    ``len()`` is the number of non-blank lines a run reads (``data.limit`` applied); it is
    counted by scanning the file once, without parsing it.
    """

    def __init__(self, path: str | Path, limit: int | None = None) -> None:
        self.path = Path(path)
        self.limit = limit
        self._count: int | None = None

    @property
    def columns(self) -> list[str]:
        return list(LINE_FIELDS)

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """``(index, raw line)`` of every non-blank line, in order; ``index`` counts from 0 over
        all lines, so ``index + 1`` is the line number an editor shows."""
        taken = 0
        with open(self.path, "rb") as f:
            for index, raw in enumerate(f):
                if not raw.strip():
                    continue
                if self.limit is not None and taken >= self.limit:
                    return
                taken += 1
                yield index, raw

    def __len__(self) -> int:
        if self._count is None:
            count = 0
            with open(self.path, "rb") as f:
                for raw in f:
                    count += bool(raw.strip())
            self._count = count if self.limit is None else min(count, self.limit)
        return self._count

    def todo(self, done: ResumeIndex | set[str]) -> int:
        """Lines this run still has to answer."""
        return max(len(self) - len(done), 0)

    def prompts(self, parser: LineParser, done: ResumeIndex) -> Iterator[BatchPrompt]:
        """Every line not answered yet, as a :class:`BatchPrompt`, in file order.

        Lines that cannot run come with ``error`` set; answered ones are skipped before their
        body is parsed, so a resume reads through the done part of the file quickly.
        """
        keyless = 0
        for index, raw in self.lines():
            custom_id, line, problem = _envelope(raw)
            first = done.first_line(custom_id, index) if custom_id is not None else None
            if custom_id is None or first is not None:
                keyless += 1
                if keyless <= done.keyless:
                    continue
                prompt = BatchPrompt(id=None, index=index, row=line or {}, custom_id=custom_id)  # type: ignore[arg-type]
                if problem is None:
                    assert first is not None
                    problem = LineError(f"Duplicate custom_id {json.dumps(custom_id)}: it was first used on line "
                                        f"{first + 1}; each line needs its own custom_id.", "custom_id",
                                        DUPLICATE_CUSTOM_ID)
                prompt.error, prompt.error_param, prompt.error_code = problem.message, problem.param, problem.code
                prompt.error = f"line {index + 1}: {prompt.error}"
                yield prompt
                continue
            if custom_id in done:
                continue
            assert line is not None
            yield parser.parse(line, custom_id, index)


    def preview(self, tokenizer: Any, model_names: Iterable[str], lines: int) -> list[str]:
        """Why each of the first ``lines`` lines would fail, for ``batchgen validate`` (which loads
        no model: the context length is not checked). Without a tokenizer only the line's
        envelope (JSON, ``custom_id``) is checked."""
        parser = LineParser(tokenizer, 2**62, model_names) if tokenizer is not None else None
        problems = []
        seen: dict[str, int] = {}
        for index, raw in islice(self.lines(), lines):
            custom_id, line, problem = _envelope(raw)
            if custom_id is not None and custom_id in seen:
                problem = LineError(f"duplicate custom_id: it was first used on line {seen[custom_id] + 1}")
            elif custom_id is not None:
                seen[custom_id] = index
            if problem is None and parser is not None and line is not None and custom_id is not None:
                prompt = parser.parse(line, custom_id, index)
                if prompt.error is not None:
                    problem = LineError(prompt.error, prompt.error_param, prompt.error_code)
            if problem is not None:
                who = f" (custom_id {json.dumps(custom_id)})" if custom_id is not None else ""
                problems.append(f"line {index + 1}{who}: {problem.message}")
        return problems


def _envelope(raw: bytes) -> tuple[str | None, dict[str, Any] | None, LineError | None]:
    """``(custom_id, line, problem)`` of one raw line; custom_id is None when unusable."""
    try:
        line = json.loads(raw)
    except UnicodeDecodeError as exc:
        return None, None, LineError(f"the line is not valid UTF-8 ({exc.reason} at byte {exc.start})", None,
                                     "invalid_json")
    except ValueError as exc:
        return None, None, LineError(f"the line is not valid JSON: {exc}", None, "invalid_json")
    if not isinstance(line, dict):
        return None, None, LineError(f"the line must be a JSON object, got {type(line).__name__}", None,
                                     "invalid_json")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        why = "is missing" if "custom_id" not in line else f"must be a non-empty string, got {json.dumps(custom_id)}"
        return None, line, LineError(f"'custom_id' {why}", "custom_id", "invalid_value")
    return custom_id, line, None


def open_input(config: RunConfig, metric_columns: dict[str, Iterable[str]] | None = None) -> BatchFile:
    """The batch file of ``data.source``.

    Raises :class:`DataError` when it cannot be read, and :class:`ConfigError` for a metric
    that reads a column a batch line does not have (``metric_columns``: metric key -> columns).
    """
    data = config.data
    issues = [
        ConfigIssue(f"metrics.{i}", f"metric '{ref.name}' reads column '{name}', which an OpenAI batch line "
                    f"does not have; columns: {', '.join(LINE_FIELDS)}")
        for i, ref in enumerate(config.metrics)
        for name in (metric_columns or {}).get(ref.key, ())
        if name not in LINE_FIELDS
    ]
    if issues:
        raise ConfigError(issues)
    path = Path(resolve_source(data.source))
    if not path.is_file():
        raise DataError(f"data.source: OpenAI batch file not found: {path}")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise DataError(f"data.source: cannot read {path}: {exc.strerror or exc}") from None
    return BatchFile(path, data.limit)


def resume_index(config: RunConfig) -> ResumeIndex:
    """The answers already in the run's output file(s) (both prepared for appending)."""
    index = ResumeIndex()
    key = response_key if config.output.format == "openai_batch" else _record_key
    for path in (config.output.path, config.output.error_path):
        if path:
            index.load(path, key)
    return index


def _record_key(record: dict[str, Any]) -> str | None:
    value = record.get("id")
    return None if value is None else str(value)


# --------------------------------------------------------------------------- output lines


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


def _logprob(value: float | None) -> float:
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
        choices = [self._choice(rank, c, endpoint, None if beam else top) for rank, c in enumerate(completions)]
        stats = output.stats
        prompt_tokens = stats.num_prompt_tokens or len(output.prompt_token_ids or ())
        completion_tokens = stats.num_generated_tokens
        body: dict[str, Any] = {
            "id": _new_id("chatcmpl-" if endpoint == "chat" else "cmpl-"),
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model,
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

    def _choice(self, rank: int, completion: Any, endpoint: str | None, top: int | None) -> dict[str, Any]:
        with_logprobs = top is not None and completion.logprobs is not None
        finish = completion.finish_reason or "length"
        if endpoint == "chat":
            return {
                "index": rank,
                "message": {"role": "assistant", "content": completion.text, "refusal": None},
                "logprobs": self._chat_logprobs(completion, top) if with_logprobs else None,
                "finish_reason": finish,
                "stop_reason": completion.stop_reason,
            }
        return {
            "index": rank,
            "text": completion.text,
            "logprobs": self._completion_logprobs(completion) if with_logprobs else None,
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

    def _completion_logprobs(self, completion: Any) -> dict[str, Any]:
        # As OpenAI: each position lists the chosen token and the best alternatives (up to logprobs + 1).
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            text, _ = self._token(token_id)
            tokens.append(text)
            token_logprobs.append(_logprob(entry.get(token_id)))
            ranked = sorted(entry.items(), key=lambda kv: -_logprob(kv[1]))
            top_logprobs.append({self._token(t)[0]: _logprob(lp) for t, lp in ranked})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
