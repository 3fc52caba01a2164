"""The hook specifications of batchgen's plugin system.

Every hook's docstring is its contract. Plugins implement hooks with
:data:`batchgen.plugins.hookimpl`; batchgen's own samplers and metrics are registered through the
very same hooks (see :mod:`batchgen.plugins.builtin_samplers` and
:mod:`batchgen.plugins.builtin_metrics`).

Hooks fire only at the edges of a run: once while the registry is built (the two
``batchgen_register_*`` hooks), once at run start, once per finished record and once at run end.
The per-token step loop never calls a hook; it calls the plain logits-processor objects (stateless
or stateful) that the sampler factories return.

This module imports neither torch nor any other heavy dependency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from batchgen.plugins.specs import MetricSpec, SamplerSpec

#: The project name shared by the markers and the plugin manager; also the entry-point group.
PROJECT_NAME = "batchgen"

#: Marks a function or method as a hook implementation: ``@hookimpl def batchgen_register_metrics(): ...``
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
#: Marks the specifications below; plugins never need it.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def batchgen_register_samplers() -> list[SamplerSpec]:
    """Return the samplers this plugin contributes, as a list of :class:`SamplerSpec`.

    Called once per registry, with no arguments. Each spec names a logits processor: its
    ``options_model`` (a pydantic model) validates the options given in the config's
    ``generation.sampler`` section, and its ``factory`` turns a validated options instance into a
    processor ``proc(logits, output_token_ids) -> logits``. The engine applies the processor on
    float32 logits of shape ``[rows, vocab]`` after penalties and temperature and before
    top-k / top-p / min-p; it masks a token by setting its logit to ``-inf`` and must return a
    tensor of the same shape. The factory may instead return a
    :class:`batchgen.plugins.StatefulLogitsProcessor`: per-sequence state made by ``new_state``,
    forked with its sequence, told each accepted token, and acting through ``fill_mask`` (a
    shared token bitmask) and/or ``process`` (row edits); see its docstring. A name that
    another plugin also registers stays reachable as ``PLUGIN:NAME`` (docs/plugins.md, "Names").
    Return an empty list to contribute nothing.
    """


@hookspec
def batchgen_register_metrics() -> list[MetricSpec]:
    """Return the metrics this plugin contributes, as a list of :class:`MetricSpec`.

    Called once per registry, with no arguments. Each spec's ``factory`` turns a validated
    ``options_model`` instance into a :class:`batchgen.metrics.Metric`: ``score(record, row)`` gives
    one record's scores (a flat dict of float / int / bool / None) and ``aggregate(scores)`` folds
    the per-record dicts into run-level floats. A name that another plugin also
    registers stays reachable as ``PLUGIN:NAME`` (docs/plugins.md, "Names"). Return an empty
    list to contribute nothing.
    """


@hookspec
def batchgen_run_start(config: dict[str, Any]) -> None:
    """Called once before the first request is submitted.

    ``config`` is the resolved run configuration as plain JSON-compatible data (the same dict that
    is written to the run summary). Treat it as read-only. The return value is ignored. An
    exception aborts the run with an error naming the plugin.
    """


@hookspec
def batchgen_record_finished(record: dict[str, Any]) -> None:
    """Called once for every record the run finishes, in finish order, after scoring.

    ``record`` is the output record exactly as it is written to the JSONL file: ``id``,
    ``prompt``, ``generations`` (each with ``text``, ``finish_reason``, ``num_tokens``,
    ``cumulative_logprob``), ``metrics`` and ``error`` (a message, or None). Records that failed
    (for example a template error) are reported too, with their ``error`` set. Treat the record
    as read-only. Records skipped by ``--resume`` are not reported. The return value is ignored.
    """


@hookspec
def batchgen_run_end(summary: dict[str, Any]) -> None:
    """Called once after the last record has been written, with the run summary.

    ``summary`` is the run summary as written beside the JSONL output: the resolved config,
    versions, timings, throughput, KV-cache statistics and the aggregated metrics. Treat it as
    read-only. The return value is ignored. It is not called when the run aborted.
    """


#: The names of every hook above, in the order they fire.
HOOK_NAMES: tuple[str, ...] = (
    "batchgen_register_samplers",
    "batchgen_register_metrics",
    "batchgen_run_start",
    "batchgen_record_finished",
    "batchgen_run_end",
)
#: The hooks that fire during a run, as opposed to while the registry is built.
LIFECYCLE_HOOKS: tuple[str, ...] = HOOK_NAMES[2:]
