"""OpenAI Batch request lines to engine requests: :class:`BatchPrompt` (one line on its way to
the engine) and :class:`LineParser` (a parsed line in, its prompt and own engine params out).

This module imports neither torch nor the engine (their parameter classes are torch-free).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from batchgen.config import PromptSection
from batchgen.openai_batch.bodies import UNSUPPORTED, ChatBody, CompletionBody, chat_messages, structured_outputs_of, validation_error
from batchgen.openai_batch.errors import (
    CHAT_URL,
    COMPLETIONS_URL,
    CONTEXT_LENGTH_EXCEEDED,
    ENDPOINTS,
    LINE_FIELDS,
    MAX_TOP_LOGPROBS,
    MODEL_NOT_FOUND,
    LineError,
)
from batchgen.engine import prompts as prompt_forms
from batchgen.io.prompts import PromptBuilder
from batchgen.io.protocols import PromptRecord
from batchgen.sampling.params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class BatchPrompt(PromptRecord):
    """One line of an OpenAI batch file on its way to the engine.

    ``id`` is the ``custom_id`` for a line that may run or be resumed, None for a line without a
    usable ``custom_id`` or a duplicate (their resume key). ``custom_id`` is what the output line
    echoes. ``endpoint`` is ``"chat"`` or ``"completion"``; ``top_logprobs`` the alternatives
    per token the response lists (None: no logprobs); ``echo`` (completions) puts the prompt
    before the completion in the text and, with logprobs, the prompt tokens' logprobs before
    the completion's. ``error_param`` and ``error_code`` go with ``error`` into the OpenAI error
    body.
    """

    custom_id: str | None = None
    endpoint: Literal["chat", "completion"] | None = None
    top_logprobs: int | None = None
    echo: bool = False
    error_param: str | None = None
    error_code: str | None = None


class LineParser:
    """Turns one parsed input line into a :class:`BatchPrompt` with its own engine params.

    Args:
        tokenizer: the model's HF tokenizer (chat template, tokens, prompt lengths).
        max_model_len: the model's context length.
        model_names: the job's model and its aliases. With no aliases every line's ``model`` is
            answered (one warning for a name that differs); with aliases, only these names (a
            404 line for another). A line without ``model`` is accepted.
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
        self._warned_model = False

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
            fields = ", ".join(unknown)
            raise LineError(f"Unrecognized field{'s' if len(unknown) > 1 else ''} in the request line: {fields}; a "
                            "line holds 'custom_id', 'method', 'url' and 'body'.", unknown[0], "unknown_parameter")
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
        schema = ChatBody if endpoint == "chat" else CompletionBody
        try:
            parsed = schema.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc, schema.model_fields) from None
        self._check_model(parsed.model)
        for name, (is_off, why) in UNSUPPORTED.items():
            if name in parsed.model_fields_set and not is_off(getattr(parsed, name)):
                raise LineError(why, name, "unsupported_parameter")
        constraint = structured_outputs_of(parsed.response_format)
        if isinstance(parsed, ChatBody):
            if not self._chat.use_chat:
                raise LineError(f"this model has no chat template; send '{COMPLETIONS_URL}' lines", "url",
                                "unsupported_value")
            record = self._chat.build(prompt.id or "", prompt.index, {"prompt": chat_messages(parsed.messages)})
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
        prompt.echo = _echo(parsed)

    def _check_model(self, model: str | None) -> None:
        """A job serving one name (no aliases) answers every line's ``model``, with one warning
        per run; a job that maps names (aliases) answers those only, else 404."""
        if model is None or model in self.model_names:
            return
        served = self.model_names[0]
        if len(self.model_names) == 1:
            if not self._warned_model:
                self._warned_model = True
                logger.warning("batchgen: warning: lines ask for model '%s'; this job serves one model, '%s', which "
                               "answers every line (map names with --model NAME=%s to answer only those)",
                               model, served, served)
            return
        raise LineError(
            f"The model '{model}' is not served by this job, which runs '{served}'; map it with "
            f"--model {model}={served} (or list it in model.aliases).",
            "model", MODEL_NOT_FOUND,
        )

    def _completion_record(self, value: Any, prompt: BatchPrompt) -> PromptRecord:
        # The engine's reading of prompts (a text, token ids, or a list of those); a line holds one.
        items = prompt_forms.as_list(value) if value != [] else [[]]
        if len(items) != 1:
            raise LineError(f"'prompt' holds {len(items)} prompts; give one prompt per line.",
                            "prompt", "invalid_value")
        text, ids = prompt_forms.parse(items[0], 0)
        if ids is None:
            return self._plain.build(prompt.id or "", prompt.index, {"prompt": text})
        if not ids:
            raise LineError("'prompt' is empty.", "prompt", "invalid_value")
        if any(t < 0 for t in ids):
            raise LineError("'prompt' token ids must be >= 0.", "prompt", "invalid_value")
        return PromptRecord(id=prompt.id or "", index=prompt.index, row={}, prompt=None, prompt_token_ids=ids)

    def _max_tokens(self, body: ChatBody | CompletionBody, num_prompt: int, where: str) -> int:
        requested = body.max_tokens
        if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
            if requested is not None and requested != body.max_completion_tokens:
                raise LineError("give one of 'max_tokens' and 'max_completion_tokens', not both",
                                "max_completion_tokens", "invalid_value")
            requested = body.max_completion_tokens
        least = 0 if _echo(body) else 1  # max_tokens 0 with echo: score the prompt, generate nothing
        if requested is not None and requested < least:
            raise LineError(f"Invalid 'max_tokens': {requested}; it must be >= {least}"
                            + (" (0 with 'echo': true scores the prompt only)." if least else "."),
                            "max_tokens", "invalid_value")
        if requested is None:
            # OpenAI's defaults: 16 for completions, the rest of the context for chat.
            requested = 16 if isinstance(body, CompletionBody) else max(self.max_model_len - num_prompt, 0)
        if requested < least or num_prompt + requested > self.max_model_len:
            raise LineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the {where}, {requested} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                where, CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def _params(self, body: ChatBody | CompletionBody, num_prompt: int, where: str, constraint: Any = None) -> Any:
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
                if _echo(body):
                    raise LineError("'echo' is not supported with 'use_beam_search'", "echo", "unsupported_parameter")
                self._check_beam_fields(body)
                if body.include_stop_str_in_output:
                    raise LineError("'include_stop_str_in_output' is not supported with 'use_beam_search'",
                                    "include_stop_str_in_output", "unsupported_parameter")
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
                # echo: the prompt's tokens are scored too (max_tokens 0 needs them even without logprobs).
                prompt_logprobs=(logprobs if logprobs is not None else 0 if max_tokens == 0 else None)
                if _echo(body) else None,
                logits_processors=list(self.logits_processors),
                include_stop_str_in_output=bool(body.include_stop_str_in_output),  # vLLM's field
                **common,
            )
        except ValueError as exc:
            message = str(exc)
            name = message.split(" ", 1)[0]
            param = name if name in type(body).model_fields else None
            raise LineError(message, param, "invalid_value") from None

    @staticmethod
    def _check_beam_fields(body: ChatBody | CompletionBody) -> None:
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
    def _engine_logprobs(body: ChatBody | CompletionBody) -> int | None:
        """The engine's ``logprobs`` (alternatives besides the chosen token), or None."""
        if isinstance(body, ChatBody):
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
    def _top_logprobs(body: ChatBody | CompletionBody) -> int | None:
        if isinstance(body, ChatBody):
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs


def _echo(body: ChatBody | CompletionBody) -> bool:
    """Whether a completions line asks for its prompt back (``echo: true``)."""
    return isinstance(body, CompletionBody) and bool(body.echo)
