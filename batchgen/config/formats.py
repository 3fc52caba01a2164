"""The run's file formats as the config knows them: which kind of prompt source ``data.format``
names, which kind of record format ``output.format`` names, which scoring kind
``generation.mode`` names (:func:`scoring_kind`), and the config rules of each.

:func:`kinds` is the one place that reads ``data.format`` and ``output.format``. It returns
kind objects, and every other module receives those objects instead of testing a format name:

* :class:`~batchgen.config.run_config.RunConfig` asks them for their config rules
  (:meth:`SourceKind.config_issues`, :meth:`RecordKind.config_issues`) and writes the record
  format that ``output.format: auto`` means back into the config;
* :func:`batchgen.run.plan.pick` builds the kinds' prompt source and record format (the
  implementations of :mod:`batchgen.io.protocols`, one table entry per kind).

The kinds live here, at the bottom of the run layer, because the config must apply their rules
when it is validated, and the config imports nothing above it. A new format is one kind here
(its names and its rules) and one entry in ``plan``'s table; a new scoring mode is one
:class:`ScoringKind` here (its mode, the keys only it reads, its rules, its implied metrics) and
one entry in :data:`batchgen.run.scoring_kinds.SCORERS`.

``config`` is a :class:`~batchgen.config.run_config.RunConfig` whose sections validated (taken
as it is, duck-typed: the config module imports this one). This module imports neither torch
nor the engine, nor anything of batchgen.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["BATCH_LINES", "BATCHGEN_RECORDS", "DATASET_ROWS", "LOGLIKELIHOOD", "PERPLEXITY", "RESPONSE_LINES",
           "SCORING_KINDS", "RecordKind", "ScoringKind", "SourceKind", "kinds", "scoring_kind"]


def explicit(section: BaseModel) -> set[str]:
    """Keys of ``section`` given with a non-default value."""
    fields = type(section).model_fields
    return {k for k in section.model_fields_set if getattr(section, k) != fields[k].get_default(call_default_factory=True)}


class RecordKind:
    """A record format as the config knows it (``output.format``).

    Attributes:
        name: its ``output.format`` value.
    """

    def __init__(self, name: str, scores_metrics: bool) -> None:
        self.name = name
        self.scores_metrics = scores_metrics

    def config_issues(self, config: Any) -> list[str]:
        """What this record format makes wrong in ``config`` (messages of the config as a whole)."""
        if self.scores_metrics or not config.metrics:
            return []
        return [f"metrics score batchgen records; with output.format '{self.name}' drop 'metrics' "
                f"or write output.format '{BATCHGEN_RECORDS.name}'"]

    def __repr__(self) -> str:
        return f"RecordKind({self.name!r})"


class SourceKind:
    """A prompt source as the config knows it (``data.format``).

    Attributes:
        format: the ``data.format`` value that picks it; None for the default kind, which every
            other value picks (the dataset loader's ``auto``, ``json``, ``csv``, ...).
        records: the record format that ``output.format: auto`` means with it.
        serves_aliases: whether its rows name the model they ask for (``model.aliases``).
    """

    def __init__(self, format: str | None, records: RecordKind, serves_aliases: bool = False) -> None:
        self.format = format
        self.records = records
        self.serves_aliases = serves_aliases

    def config_issues(self, config: Any) -> list[str]:
        """What this source makes wrong in ``config`` (messages of the config as a whole)."""
        if config.model.aliases and not self.serves_aliases:
            which = " or ".join(f"'{kind.format}'" for kind in _SOURCES.values() if kind.serves_aliases)
            return [f"'model.aliases' applies to data.format {which} only"]
        return []

    def __repr__(self) -> str:
        return f"SourceKind({self.format!r})"


class _BatchLinesKind(SourceKind):
    """An OpenAI batch file: each line carries its own prompt and generation parameters, so the
    keys of the config that say how to build them are meaningless (``data.source``,
    ``data.limit``, a sampler plugin and ``model.aliases`` still apply)."""

    def config_issues(self, config: Any) -> list[str]:
        problems = super().config_issues(config)
        given = [f"data.{k}" for k in sorted(explicit(config.data)) if k not in ("source", "format", "limit")]
        given += [f"prompt.{k}" for k in sorted(explicit(config.prompt))]
        given += [f"generation.{k}" for k in sorted(explicit(config.generation)) if k != "sampler"]
        if given:
            problems.append(f"with data.format '{self.format}' each line carries its own prompt and generation "
                            f"parameters; drop {', '.join(repr(k) for k in given)}")
        return problems


#: batchgen's own records (``output.format: jsonl``).
BATCHGEN_RECORDS = RecordKind("jsonl", scores_metrics=True)
#: OpenAI Batch API response lines (``output.format: openai_batch``).
RESPONSE_LINES = RecordKind("openai_batch", scores_metrics=False)
#: The rows of a dataset, rendered by the ``prompt`` section (every ``data.format`` but those below).
DATASET_ROWS = SourceKind(None, BATCHGEN_RECORDS)
#: The lines of an OpenAI Batch API input file.
BATCH_LINES = _BatchLinesKind("openai_batch", RESPONSE_LINES, serves_aliases=True)

_SOURCES = {kind.format: kind for kind in (BATCH_LINES,)}
_RECORDS = {kind.name: kind for kind in (BATCHGEN_RECORDS, RESPONSE_LINES)}


def kinds(config: Any) -> tuple[SourceKind, RecordKind]:
    """The kinds of ``config``'s prompt source and record format; ``output.format: auto`` is the
    source's :attr:`SourceKind.records`. The only place that reads ``data.format`` and
    ``output.format`` (the schema's choices, so every value has a kind)."""
    source = _SOURCES.get(config.data.format, DATASET_ROWS)
    return source, source.records if config.output.format == "auto" else _RECORDS[config.output.format]


class ScoringKind:
    """A scoring mode as the config knows it (``generation.mode``: score given text instead of
    generating).

    Attributes:
        mode: its ``generation.mode`` value.
        keys: the ``generation`` keys that only this kind reads (an error in any other mode).
        what: what one of a row's requests scores (``"choice"``, ``"window"``), for messages.
    """

    def __init__(self, mode: str, what: str, keys: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.what = what
        self.keys = keys

    def config_issues(self, generation: Any) -> list[str]:
        """What this kind makes wrong in the ``generation`` section (messages of the section)."""
        return []

    def implied_metrics(self, generation: Any) -> list[str]:
        """The metric names a job of this kind gets when its config lists none."""
        return []

    def __repr__(self) -> str:
        return f"ScoringKind({self.mode!r})"


class _ChoicesKind(ScoringKind):
    """Multiple choice: each row's ``choices`` scored given its prompt."""

    def config_issues(self, generation: Any) -> list[str]:
        if generation.choices is None:
            return [f"mode '{self.mode}' needs 'choices': a column holding each row's list of choices, "
                    "or a list of templates"]
        if isinstance(generation.choices, list) and not generation.choices:
            return ["'choices' is an empty list; give at least one template"]
        return []

    def implied_metrics(self, generation: Any) -> list[str]:
        return ["accuracy", "accuracy_norm"] if generation.answer is not None else []


class _RollingKind(ScoringKind):
    """Perplexity: each row's text scored in rolling windows."""

    def implied_metrics(self, generation: Any) -> list[str]:
        return ["perplexity"]


#: ``generation.mode: loglikelihood``: multiple choice.
LOGLIKELIHOOD = _ChoicesKind("loglikelihood", "choice", keys=("choices", "answer", "target_delimiter", "truncate"))
#: ``generation.mode: perplexity``: a text's rolling log-likelihood.
PERPLEXITY = _RollingKind("perplexity", "window")

#: Every scoring kind by its ``generation.mode``.
SCORING_KINDS = {kind.mode: kind for kind in (LOGLIKELIHOOD, PERPLEXITY)}


def scoring_kind(generation: Any) -> ScoringKind | None:
    """The scoring kind ``generation.mode`` names; None for a mode that generates. The only
    place that tells a scoring mode by its name."""
    return SCORING_KINDS.get(generation.mode)
