"""Prompts of dataset rows: render the template, apply the chat template, tokenize, check.

Contract:

* Problems with one row (its template fails, its prompt is empty or too long, a chat message
  with an unknown role) never raise: the row's :class:`~batchgen.io.protocols.PromptRecord`
  carries ``error`` and becomes an error record in the output. A prompt is empty when the
  user's text is blank, before any chat template wraps it.
* Templates render in Jinja's sandbox with ``StrictUndefined``: the row's columns are top-level
  variables, and ``row`` (the whole row) and ``index`` (the row's position) are there too.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from batchgen.config import PromptSection
from batchgen.io.dataset import DataError, LoadedData
from batchgen.io.protocols import PromptRecord

__all__ = ["CHAT_ROLES", "PromptBuilder", "iter_prompts"]

#: The roles a chat message of a dataset row may have.
CHAT_ROLES = ("system", "user", "assistant")


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _is_blank(rendered: str | list[dict[str, Any]]) -> bool:
    """A prompt with no text: blank, or chat messages whose contents are all blank."""
    if isinstance(rendered, str):
        return not rendered.strip()
    return all(isinstance(m.get("content"), str) and not m["content"].strip() for m in rendered)


class PromptBuilder:
    """Turns a row into the model's input text (and tokens), or into an error message.

    Args:
        cfg: the ``prompt`` section.
        tokenizer: an HF tokenizer, or None (then no chat template, no tokens, no length check).
        max_model_len: the model's context length (positions for prompt + generation).
        max_tokens: ``generation.max_tokens``; a prompt must leave room for it.

    Raises:
        DataError: ``chat_template: true`` with a tokenizer that has no chat template.
    """

    def __init__(
        self,
        cfg: PromptSection,
        tokenizer: Any = None,
        max_model_len: int | None = None,
        max_tokens: int = 0,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        self.template = env.from_string(cfg.template) if cfg.template is not None else None
        has_chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        if cfg.chat_template and tokenizer is not None and not has_chat:
            raise DataError("prompt.chat_template is true, but the model's tokenizer has no chat template")
        self.use_chat = has_chat and cfg.chat_template is not False

    def render(self, row: dict[str, Any], index: int) -> str | list[dict[str, Any]]:
        """The row's prompt before the chat template: text, or a list of chat messages.

        Raises ValueError with a user-facing message when the row cannot be rendered.
        """
        if self.template is not None:
            try:
                return self.template.render({"row": row, "index": index, **row})
            except jinja2.TemplateError as exc:
                raise ValueError(f"prompt template failed: {type(exc).__name__}: {exc.message or exc}") from None
            except Exception as exc:  # a filter or method raised on this row's values
                raise ValueError(f"prompt template failed: {type(exc).__name__}: {exc}") from None
        column = self.cfg.prompt_column
        assert column is not None
        value = row.get(column)
        if value is None:
            raise ValueError(f"column '{column}' is empty (null) in this row")
        if _is_messages(value):
            for i, message in enumerate(value):
                if message["role"] not in CHAT_ROLES:
                    raise ValueError(
                        f"column '{column}': message {i} has role {message['role']!r}; expected one of "
                        + ", ".join(f"'{r}'" for r in CHAT_ROLES)
                    )
            return value
        if not isinstance(value, str):
            raise ValueError(
                f"column '{column}' holds {type(value).__name__}, expected text or a list of chat messages"
            )
        return value

    def to_text(self, rendered: str | list[dict[str, Any]]) -> tuple[str, bool]:
        """Apply the chat template if in use; return (text, whether the template was applied)."""
        if not self.use_chat:
            if isinstance(rendered, list):
                raise ValueError("this row holds chat messages, but no chat template is in use")
            return rendered, False
        messages = [{"role": "user", "content": rendered}] if isinstance(rendered, str) else list(rendered)
        if self.cfg.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        return text, True

    def build(self, record_id: str, index: int, row: dict[str, Any]) -> PromptRecord:
        """A :class:`PromptRecord` for the row; failures land in ``error``, never raise."""
        record = PromptRecord(id=record_id, index=index, row=row)
        try:
            rendered = self.render(row, index)
            if _is_blank(rendered):  # the user's text, before a chat template wraps it
                record.prompt = rendered if isinstance(rendered, str) else None
                record.error = "the prompt is empty"
                return record
            text, templated = self.to_text(rendered)
        except ValueError as exc:
            record.error = str(exc)
            return record
        record.prompt, record.chat = text, templated
        if not text.strip():
            record.error = "the prompt is empty"
            return record
        if self.tokenizer is None:
            return record
        # A chat template already wrote the special tokens it wants (BOS and role markers).
        ids = list(self.tokenizer(text, add_special_tokens=not templated)["input_ids"])
        record.prompt_token_ids = ids
        limit = self.cfg.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            record.error = f"prompt too long: {len(ids)} tokens, over prompt.max_prompt_tokens={limit}"
        elif self.max_model_len is not None and len(ids) + self.max_tokens > self.max_model_len:
            record.error = (
                f"prompt too long: {len(ids)} tokens + generation.max_tokens={self.max_tokens} "
                f"exceeds the model's context length of {self.max_model_len} tokens"
            )
        return record


def iter_prompts(data: LoadedData, builder: PromptBuilder, skip_ids: Container[str] = frozenset()) -> Iterator[PromptRecord]:
    """Build the prompt of every row whose id is not in ``skip_ids``, lazily, in dataset order."""
    for position, row in enumerate(data.dataset):
        record_id = data.ids[position]
        if record_id in skip_ids:
            continue
        yield builder.build(record_id, data.indices[position], dict(row))
