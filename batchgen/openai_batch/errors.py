"""The wire constants of OpenAI Batch lines and :class:`LineError`, why one line cannot run.

This module imports nothing heavy.
"""

from __future__ import annotations

from typing import Literal

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



class LineError(Exception):
    """Why one line cannot run: becomes its status-400 output line."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
