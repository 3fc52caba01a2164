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

The package, one noun a module: :mod:`~batchgen.openai_batch.errors` (wire constants,
:class:`LineError`), :mod:`~batchgen.openai_batch.bodies` (request bodies and their checks),
:mod:`~batchgen.openai_batch.requests` (a line to an engine request),
:mod:`~batchgen.openai_batch.batch_file` (the input file and resume),
:mod:`~batchgen.openai_batch.responses` (output lines), and the two protocols of
:mod:`batchgen.io.protocols` that the run loop sees: :mod:`~batchgen.openai_batch.source`
(the lines as a prompt source) and :mod:`~batchgen.openai_batch.response_lines` (response lines
as a record format).

This package imports neither torch nor the engine (their parameter classes are torch-free).
"""

from batchgen.openai_batch.batch_file import AnsweredOnDisk, BatchFile, open_input
from batchgen.openai_batch.errors import (
    CHAT_URL,
    COMPLETIONS_URL,
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_CUSTOM_ID,
    MODEL_NOT_FOUND,
    LineError,
)
from batchgen.openai_batch.requests import BatchPrompt, LineParser
from batchgen.openai_batch.response_lines import ResponseLines
from batchgen.openai_batch.responses import ResponseBuilder, error_line, error_message, is_failed, response_key
from batchgen.openai_batch.source import BatchLines

__all__ = [
    "AnsweredOnDisk",
    "BatchFile",
    "BatchLines",
    "BatchPrompt",
    "CHAT_URL",
    "COMPLETIONS_URL",
    "CONTEXT_LENGTH_EXCEEDED",
    "DUPLICATE_CUSTOM_ID",
    "LineError",
    "LineParser",
    "MODEL_NOT_FOUND",
    "ResponseBuilder",
    "ResponseLines",
    "error_line",
    "error_message",
    "is_failed",
    "open_input",
    "response_key",
]
