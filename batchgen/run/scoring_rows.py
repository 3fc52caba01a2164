"""Dataset rows of a scoring job (``generation.mode: loglikelihood`` or ``perplexity``) as a
:class:`~batchgen.io.protocols.PromptSource`.

Each row becomes one :class:`~batchgen.io.protocols.PromptRecord` carrying several engine
requests (``PromptRecord.requests``), built exactly as ``LLM.loglikelihood`` and
``LLM.loglikelihood_rolling`` build theirs (:mod:`batchgen.engine.loglikelihood`: lm-eval's
tokenisation, windows and scoring-only requests), so that a job's numbers are the API's:

* ``loglikelihood``: the prompt (``prompt.column`` or ``prompt.template``) is the context; each
  choice (``generation.choices``: a column holding a list, or a list of templates), with
  ``generation.target_delimiter`` before it, is one ``(context, continuation)`` request. All
  choices of a row share the context's KV blocks (prefix cache, or the same step's prefill).
* ``perplexity``: the prompt text is scored in lm-eval's disjoint rolling windows of the
  model's length, one request per window (one request when the text fits).

No chat template wraps the text unless ``prompt.chat_template: true`` (scoring reads the text
as written, as lm-eval does). Problems of one row (a missing or bad choice, an answer out of
range, an empty continuation, a pair longer than the model's window without
``generation.truncate``) become that row's error record; a missing column is a config error
when the source is built (``batchgen validate`` exits 2).

This module imports neither torch nor the engine at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from batchgen.config import ConfigError, ConfigIssue, RunConfig
from batchgen.io.dataset import check_columns, load_rows, template_variables
from batchgen.io.prompts import PromptBuilder
from batchgen.io.protocols import EngineView, Preview, PromptRecord, ResumeIndex

__all__ = ["ScoringRows", "answer_index", "count_words"]

#: Names a template sees besides the row's columns.
_TEMPLATE_NAMES = frozenset({"row", "index"})


def count_words(text: str) -> int:
    """Words as lm-eval's ``wikitext`` counts them: the pieces of ``re.split(r"\\s+", text)``."""
    import re

    return len(re.split(r"\s+", text))


def answer_index(value: Any, choices: list[str]) -> int:
    """The index of the right choice from an answer column's value (an index, or a choice's
    text). Raises ValueError naming what is wrong."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"the answer is {value!r}; expected the index of a choice or its text")
    if isinstance(value, int):
        if not 0 <= value < len(choices):
            raise ValueError(f"the answer index {value} is out of range: the row has {len(choices)} choices "
                             f"(0..{len(choices) - 1})")
        return value
    if isinstance(value, str):
        if value in choices:
            return choices.index(value)
        if value.strip().lstrip("-").isdigit():
            return answer_index(int(value), choices)
        raise ValueError(f"the answer {value!r} is none of the row's choices")
    raise ValueError(f"the answer holds {type(value).__name__}; expected the index of a choice or its text")


class ScoringRows:
    """The rows of ``data`` for a scoring job, loaded and checked when built.

    Raises:
        DataError, ConfigError: the data cannot be loaded, or a column the job reads is missing
            (``generation.choices``, ``generation.answer``, a template's variable, a metric's).
    """

    def __init__(self, config: RunConfig, metric_columns: dict[str, Iterable[str]] | None = None) -> None:
        self.config = config
        self.gen = config.generation
        self.data = load_rows(config.data)
        self.columns = self.data.columns
        check_columns(self.columns, config, metric_columns)
        self._check_scoring_columns()
        env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        self.choice_templates = ([env.from_string(t) for t in self.gen.choices]
                                 if isinstance(self.gen.choices, list) else None)

    def _check_scoring_columns(self) -> None:
        issues = []

        def need(column: str, key: str) -> None:
            if column not in self.columns:
                listed = ", ".join(f"'{c}'" for c in self.columns)
                issues.append(ConfigIssue(key, f"column '{column}' is not in the dataset; columns: {listed}"))

        if isinstance(self.gen.choices, str):
            need(self.gen.choices, "generation.choices")
        elif isinstance(self.gen.choices, list):
            for i, template in enumerate(self.gen.choices):
                try:
                    names = template_variables(template)
                except jinja2.TemplateSyntaxError as exc:
                    issues.append(ConfigIssue(f"generation.choices.{i}", f"template syntax error: {exc.message}"))
                    continue
                for name in sorted(names - _TEMPLATE_NAMES):
                    need(name, f"generation.choices.{i}")
        if self.gen.answer is not None:
            need(self.gen.answer, "generation.answer")
        if issues:
            raise ConfigError(issues)

    def __len__(self) -> int:
        return len(self.data)

    def todo(self, answered: ResumeIndex) -> int:
        return sum(1 for i in self.data.ids if i not in answered)

    def _builder(self, tokenizer: Any) -> PromptBuilder:
        prompt = self.config.prompt
        if prompt.chat_template is not True:
            prompt = prompt.model_copy(update={"chat_template": False})
        return PromptBuilder(prompt, tokenizer, None, 0)

    def choices_of(self, row: dict[str, Any], index: int) -> list[str]:
        """The row's choices as text (ValueError naming the problem)."""
        if self.choice_templates is not None:
            out = []
            for i, template in enumerate(self.choice_templates):
                try:
                    out.append(template.render({"row": row, "index": index, **row}))
                except Exception as exc:
                    raise ValueError(f"choice template {i} failed: {type(exc).__name__}: {exc}") from None
            return out
        column = str(self.gen.choices)
        value = row.get(column)
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"column '{column}' holds {type(value).__name__}, expected a non-empty list of choices")
        bad = [i for i, c in enumerate(value) if not isinstance(c, str)]
        if bad:
            raise ValueError(f"column '{column}': choice {bad[0]} is {type(value[bad[0]]).__name__}, expected text")
        return list(value)

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        builder = self._builder(engine.tokenizer)
        for position, row in enumerate(self.data.dataset):
            record_id = self.data.ids[position]
            if record_id in answered:
                continue
            prompt = builder.build(record_id, self.data.indices[position], dict(row))
            if prompt.error is None:
                try:
                    self._requests(prompt, engine)
                except ValueError as exc:
                    prompt.error = str(exc)
            yield prompt

    def _requests(self, prompt: PromptRecord, engine: EngineView) -> None:
        """Fill ``prompt.requests`` and ``prompt.meta`` (ValueError: the row cannot run)."""
        from batchgen.engine import loglikelihood as ll

        tokenizer, max_length = engine.tokenizer, engine.max_model_len
        text = prompt.prompt or ""
        if self.gen.mode == "perplexity":
            tokens = ll.encode(tokenizer, text)
            windows = ll.rolling_windows(tokens, ll.prefix_token_id(tokenizer), max_length)
            prompt.requests = [ll.to_request(f"{prompt.id}\x1fw{j}", ctx, cont) for j, (ctx, cont) in enumerate(windows)]
            prompt.meta = {"num_tokens": len(tokens), "num_words": count_words(text),
                           "num_bytes": len(text.encode("utf-8"))}
            return
        choices = self.choices_of(prompt.row, prompt.index)
        answer = None
        if self.gen.answer is not None:
            answer = answer_index(prompt.row.get(self.gen.answer), choices)
        requests, counts = [], []
        for j, choice in enumerate(choices):
            continuation = self.gen.target_delimiter + choice
            if not choice.strip():
                raise ValueError(f"choice {j} is empty (it has no tokens to score)")
            context_ids, continuation_ids = ll.encode_pair(tokenizer, text, continuation)
            if not continuation_ids:
                raise ValueError(f"choice {j} ({choice!r:.40}) has no tokens of its own to score")
            fitted = ll.fit_window(context_ids, continuation_ids, max_length, self.gen.truncate)
            if isinstance(fitted, str):
                raise ValueError(f"choice {j}: {fitted}; set generation.truncate: true to score it anyway")
            requests.append(ll.to_request(f"{prompt.id}\x1fc{j}", *fitted))
            counts.append(len(continuation_ids))
        prompt.requests = requests
        prompt.meta = {"choices": choices, "num_tokens": counts, "answer": answer}

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        """Render the first ``rows`` rows (context and choices); a failing row is an issue."""
        builder = self._builder(tokenizer)
        issues, notes = [], []
        shown = 0
        for position, row in enumerate(self.data.dataset):
            if shown >= rows:
                break
            shown += 1
            row = dict(row)
            prompt = builder.build(self.data.ids[position], self.data.indices[position], row)
            if prompt.error is not None:
                issues.append(("prompt", f"row id {prompt.id!r}: {prompt.error}"))
                continue
            if self.gen.mode == "loglikelihood":
                try:
                    choices = self.choices_of(row, prompt.index)
                    if self.gen.answer is not None:
                        answer_index(row.get(self.gen.answer), choices)
                except ValueError as exc:
                    notes.append(f"row id {prompt.id!r}: {exc}")
        checked = f"{len(self)} rows from {self.config.data.source}, {self.gen.mode} rows render on the first {shown}"
        return Preview(checked, issues, notes)
