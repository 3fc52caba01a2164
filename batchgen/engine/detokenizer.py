"""Incremental detokenisation: text grows token by token and equals decoding all at once.

Byte-level BPE tokens may split a UTF-8 character; the text of such a token is held back
until the character completes. Each step decodes only a short window of recent tokens.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens incrementally.

    Invariant: after the last token, ``text`` equals
    ``tokenizer.decode(token_ids, skip_special_tokens=...)`` for the tokenizers we ship
    (tested), and the engine checks the final text against a full decode anyway.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text (maybe empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            new_text = full_text[len(prefix_text) :]
            # The window restarts at the last emitted token: decoding it together with the
            # next tokens keeps boundary spacing right for tokenizers that strip a leading space.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += new_text
            return new_text
        return ""
