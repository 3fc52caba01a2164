"""The two protocols that the run loop sees instead of file-format names.

A job reads its rows through a :class:`PromptSource` and writes its records through a
:class:`RecordFormat`. :func:`batchgen.config.formats.kinds` picks the kind of both once, from
``data.format`` and ``output.format`` (the only place that reads those two keys; the config
applies each kind's rules when it is validated), and :func:`batchgen.run.plan.pick` builds the
two objects of those kinds; the loop, the summary, resume and the CLI then call the objects and
never test a format name again.

Today's implementations:

================================  =========================================================
prompt sources                    ``data.format``
================================  =========================================================
dataset rows                      ``auto``/``json``/``csv``/...: rows of an HF dataset,
                                  rendered by the ``prompt`` section
OpenAI batch lines                ``openai_batch``: each line carries its prompt and params
================================  =========================================================

================================  =========================================================
record formats                    ``output.format``
================================  =========================================================
batchgen records                  ``jsonl``: ``{"id", "index", "prompt", "generations", ...}``
OpenAI response lines             ``openai_batch``: ``{"id", "custom_id", "response", "error"}``
================================  =========================================================

Any source goes with any format (dataset rows can be answered as OpenAI lines, a batch file
as batchgen records).

How one row travels (the contracts below say who promises what):

1. ``plan`` builds the source and the format (no model loaded yet) and repairs the output
   files; ``format.resume_index(records)`` reads what they already answer.
2. ``execute`` starts the executor, then asks ``format.builder(engine)`` for a
   :class:`RecordBuilder` and ``source.prompts(engine, answered)`` for the
   :class:`PromptRecord` of every row not answered yet.
3. A prompt without ``error`` goes to the engine as
   ``Request(prompt.id, prompt.prompt_token_ids or prompt.prompt, prompt.params)``; its
   ``RequestOutput`` comes back and ``builder.make(prompt, output)`` makes its record. A prompt
   with ``error`` never reaches the engine: ``builder.make(prompt, None)`` makes its error record
   at once. An output with ``error`` set (the engine could not run that request) also becomes
   an error record. Either way exactly one record per row.
   A prompt whose ``requests`` is set (a scoring row: one request per choice, or per rolling
   window) sends those requests instead, all in the same run (so that they share the context's
   KV blocks), and ``builder.make(prompt, outputs)`` gets the list of their ``RequestOutput``\ s,
   in the order of ``requests``, once the last one has arrived: still one record per row.
4. Each record goes to the output file, or to ``output.error_path`` when
   ``format.failed(record)``; the summary reads the files back through ``format``.

Adding a format means one class with the methods of :class:`RecordFormat` (and a
:class:`RecordBuilder`), its kind in :mod:`batchgen.config.formats` (its ``output.format`` name,
also among the schema's choices in :mod:`batchgen.config.sections`, and its config rules) and one
entry in ``plan``'s table of kinds; nothing else changes.

Adding a quant block type (kept quantized in GGUF files) is of the same kind: a row in
``kernels/cpu/quant_formats.py`` and a row in ``kernels/cpu/quant.c`` (its functions in the
``quant_*.h`` it includes); see docs/kernels.md,
"Adding a quant block type".

This module imports nothing of batchgen but the engine's output types (for annotations only),
and neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from batchgen.engine.outputs import RequestOutput

__all__ = [
    "AnsweredKeys",
    "EngineView",
    "Preview",
    "PromptRecord",
    "PromptSource",
    "RecordBuilder",
    "RecordFormat",
    "ResumeIndex",
]


@dataclass
class PromptRecord:
    """One row on its way to the engine: what a :class:`PromptSource` yields.

    Attributes:
        id: the row's resume key (a dataset row's id, a batch line's ``custom_id``), or None
            for a row that has none (an OpenAI line without a usable ``custom_id``); a source
            never yields two runnable prompts with the same id.
        index: the row's position in its source (0-based), for the record.
        row: the row as read (a dataset row's columns, a batch line's JSON object); metrics
            read it.
        prompt: the exact text sent to the model (after any chat template), or None (token
            ids given, or the row failed before it was rendered).
        prompt_token_ids: its tokens, when the source tokenised it.
        error: why this row cannot run (set means: never sent to the engine; its record is an
            error record). A source puts every problem of one row here and never raises for it.
        params: the engine parameters of this row (a ``SamplingParams`` or ``BeamSearchParams``);
            set on every prompt without ``error``.
        chat: whether a chat template wrapped the prompt (None when not known, e.g. a row
            that failed first); an OpenAI record answers ``chat.completion`` when True.
        requests: the engine requests of a row that needs several (a scoring row), or None for
            one request built from ``prompt``/``prompt_token_ids`` and ``params``. Their ids are
            unique within the run (the source's promise); the builder gets all their outputs.
        meta: what the source tells its record builder about the row (e.g. a scoring row's
            choices, their token counts and the answer's index); the record format reads it.
        lora_request: the LoRA adapter (a ``batchgen.lora.LoRARequest``) the row runs under,
            or None (the base model); see :mod:`batchgen.run.adapters`.
    """

    id: str | None
    index: int
    row: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    error: str | None = None
    params: Any = None
    chat: bool | None = None
    requests: list[Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    lora_request: Any = None


class EngineView(Protocol):
    """What a started executor tells a source and a record builder about the model."""

    #: The model's HF tokenizer (chat template, tokens, token strings of logprobs).
    tokenizer: Any
    #: The model's context length: prompt + generation positions.
    max_model_len: int


@runtime_checkable
class ResumeIndex(Protocol):
    """What the output file(s) already answer: built by :meth:`RecordFormat.resume_index`.

    ``key in index`` is True for a key that one record of the files answers; ``keyless`` counts
    the records whose key is None (answered in source order, so a source skips its first
    ``keyless`` keyless rows); ``len(index)`` is every answered record, keyless ones included.
    """

    keyless: int

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class AnsweredKeys(set):  # type: ignore[type-arg]
    """A :class:`ResumeIndex` held in memory: a set of keys plus the keyless count.

    Fine for the rows of a dataset (their ids are in memory already); a source of unbounded
    length may keep its index on disk instead.
    """

    def __init__(self, keys: Iterable[str] = (), keyless: int = 0) -> None:
        super().__init__(keys)
        self.keyless = keyless

    def __len__(self) -> int:
        return super().__len__() + self.keyless

    @classmethod
    def of(cls, records: Iterable[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], str | None]) -> AnsweredKeys:
        """The index of ``records`` under ``key`` (a :meth:`RecordFormat.key`)."""
        index = cls()
        for record in records:
            value = key(record)
            if value is None:
                index.keyless += 1
            else:
                index.add(value)
        return index


@dataclass
class Preview:
    """What ``batchgen validate`` learns from the first rows of a source (no model loaded).

    Attributes:
        checked: one clause for the ok line, e.g. ``"12 rows from q.jsonl, template renders
            on the first 5"``.
        issues: ``(key path, message)`` of each problem that would stop or spoil the run
            (validate exits 2 and lists them all, with the config's other errors).
        notes: problems of single rows that a run answers with their own error record (validate
            prints them as ``note:`` lines and still says ok).
        failed_rows: how many of the rows checked would be error records (validate applies
            ``--max-failed-rows`` to it, as a run does to its error records).
    """

    checked: str
    issues: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed_rows: int = 0


class PromptSource(Protocol):
    """Rows in, engine requests out (``data.format``).

    Built by ``plan`` from the config (with the job's sampler processors), before any model is
    loaded: building it reads or opens the data and raises ``DataError`` / ``ConfigError`` for
    problems with the data as a whole (missing file, missing column, duplicate ids). After that
    nothing of it raises for one row.
    """

    #: What a metric's ``required_columns`` may name (checked by the source when it is built).
    columns: list[str]

    def __len__(self) -> int:
        """Rows the job reads (``data.limit`` applied): the summary's ``dataset_rows``."""
        ...

    def todo(self, answered: ResumeIndex) -> int:
        """Rows still to answer, given what the outputs hold (progress bar, "nothing left")."""
        ...

    def prompts(self, engine: EngineView, answered: ResumeIndex) -> Iterator[PromptRecord]:
        """Every row that ``answered`` does not answer yet, lazily, in source order.

        A keyed row is skipped when its id is in ``answered``; the first ``answered.keyless``
        keyless rows are skipped. A row that cannot run is yielded with ``error`` set (a bad
        template, an empty or too long prompt, an invalid batch line, an unknown chat role...);
        every other prompt has ``params`` set. Never raises for one row.
        """
        ...

    def preview(self, tokenizer: Any, rows: int) -> Preview:
        """Check the first ``rows`` rows for ``batchgen validate``; ``tokenizer`` may be None
        (the model's tokenizer is not local): then only what needs none is checked."""
        ...


class RecordBuilder(Protocol):
    """Makes the records of one run (needs the started engine: a tokenizer, the model's length)."""

    def make(self, prompt: PromptRecord, output: RequestOutput | list[RequestOutput] | None) -> dict[str, Any]:
        """The record answering ``prompt``.

        ``output`` is the engine's result, or None for a prompt that never reached the engine
        (then ``prompt.error`` is set); for a prompt with ``requests``, the list of their
        results, in that order. The record is an error record (see
        :meth:`RecordFormat.failed`) when ``prompt.error`` or ``output.error`` is set, or when
        the format's own step fails for this row (e.g. a metric); it never raises for one row.
        The record's key (:meth:`RecordFormat.key`) is ``prompt.id``.
        """
        ...


class RecordFormat(Protocol):
    """Results in, records out, and read back (``output.format``).

    Built by ``plan`` from the config (no model). Reading back is all that the summary's counts,
    ``--max-error-rate`` and resume need to know of a format. A record is a JSON object with an
    ``"id"`` field (the writer's files are checked for it on resume).
    """

    def builder(self, engine: EngineView) -> RecordBuilder:
        """The record maker of a run on ``engine`` (called once, after the engine started)."""
        ...

    def key(self, record: Mapping[str, Any]) -> str | None:
        """The resume key a record answers (its row's id), or None for a keyless record."""
        ...

    def resume_index(self, records: Iterable[Mapping[str, Any]]) -> ResumeIndex:
        """What ``records`` (those of every output file, in file order) answer; usually
        ``AnsweredKeys.of(records, self.key)``."""
        ...

    def failed(self, record: Mapping[str, Any]) -> bool:
        """True for an error record (it goes to ``output.error_path`` when one is set)."""
        ...

    def output_tokens(self, record: Mapping[str, Any]) -> int:
        """The generated tokens a record keeps (the summary's ``output_tokens``)."""
        ...

    def describe_error(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A small JSON object naming an error record and its error, for the summary's
        ``first_error`` (``{"id", "error"}``, ``{"custom_id", "error"}``)."""
        ...

    def example(self, described: Mapping[str, Any]) -> str:
        """One phrase for messages from a :meth:`describe_error`: ``id 'q00': <error>``."""
        ...

    def summary_counts(self, counts: Mapping[str, Any]) -> dict[str, Any]:
        """Extra top-level summary entries from the record counts (``total``, ``ok``,
        ``error``, ``this_run``...); e.g. OpenAI's ``request_counts``. ``{}`` for none."""
        ...
