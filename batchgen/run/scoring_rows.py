"""Dataset rows of a scoring job (``generation.mode: loglikelihood`` or ``perplexity``) as a
:class:`~batchgen.io.protocols.PromptSource`.

Each row becomes one :class:`~batchgen.io.protocols.PromptRecord` carrying several engine
requests (``PromptRecord.requests``), built by the job's scorer
(:data:`batchgen.run.scoring_kinds.SCORERS`: the choices of a row, or the windows of its text)
exactly as ``LLM.loglikelihood`` and ``LLM.loglikelihood_rolling`` build theirs. This module
loads and checks the rows, renders the prompt (``prompt.column`` or ``prompt.template``) and the
choices (``generation.choices``: a column holding a list, or a list of templates).

No chat template wraps the text unless ``prompt.chat_template: true`` (scoring reads the text
as written, as lm-eval does). Problems of one row (a missing or bad choice, an answer that is
none of the choices or a row without one, text with no tokens, a pair longer than the model's
window without ``generation.truncate``) become that row's error record at ``run`` and a note at
``validate`` (both then apply ``--max-failed-rows``); a missing column is a config error when
the source is built (``batchgen validate`` exits 2).

This module imports neither torch nor the engine.
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
from batchgen.run.scoring_kinds import Scorer

__all__ = ["ScoringRows"]

#: Names a template sees besides the row's columns.
_TEMPLATE_NAMES = frozenset({"row", "index"})
#: Failing rows that ``preview`` names one by one (the rest are counted).
_NOTES = 5


class ScoringRows:
    """The rows of ``data`` for a scoring job, loaded and checked when built.

    Raises:
        DataError, ConfigError: the data cannot be loaded, or a column the job reads is missing
            (``generation.choices``, ``generation.answer``, a template's variable, a metric's).
    """

    def __init__(self, config: RunConfig, scorer: Scorer,
                 metric_columns: dict[str, Iterable[str]] | None = None) -> None:
        self.config = config
        self.scorer = scorer
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

    def _prompt(self, builder: PromptBuilder, position: int, row: dict[str, Any]) -> PromptRecord:
        """The row's prompt as text (no emptiness rule here: the scorer refuses text with no
        tokens, and scores any other, whitespace included, as the API does)."""
        prompt = PromptRecord(id=self.data.ids[position], index=self.data.indices[position], row=row)
        try:
            prompt.prompt, prompt.chat = builder.to_text(builder.render(row, prompt.index))
        except ValueError as exc:
            prompt.error = str(exc)
        return prompt

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        builder = self._builder(engine.tokenizer)
        for position, row in enumerate(self.data.dataset):
            if self.data.ids[position] in answered:
                continue
            prompt = self._prompt(builder, position, dict(row))
            if prompt.error is None:
                try:
                    self.scorer.requests(self, prompt, engine)
                except ValueError as exc:
                    prompt.error = str(exc)
            yield prompt

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        """Check the first ``rows`` rows as far as no model is needed (the prompt renders, the
        choices render, the answer is one of them, and with ``tokenizer`` each choice or text
        has tokens to score); each row that would fail is a note, and ``Preview.failed_rows``
        counts them."""
        builder = self._builder(tokenizer)
        notes, failed, shown = [], 0, 0
        for position, row in enumerate(self.data.dataset):
            if shown >= rows:
                break
            shown += 1
            prompt = self._prompt(builder, position, dict(row))
            try:
                if prompt.error is not None:
                    raise ValueError(prompt.error)
                self.scorer.check(self, prompt, tokenizer)
            except ValueError as exc:
                failed += 1
                if len(notes) < _NOTES:
                    notes.append(f"row id {prompt.id!r}: {exc}")
        if failed > len(notes):
            notes.append(f"{failed - len(notes)} more of the first {shown} rows would fail")
        checked = (f"{len(self)} rows from {self.config.data.source}, {self.gen.mode} rows checked on the first "
                   f"{shown}" + (f" ({failed} would fail)" if failed else ""))
        return Preview(checked, notes=notes, failed_rows=failed)
