"""One run: config -> dataset -> engine -> metrics -> JSONL records + run summary.

The run is split in two so the CLI can tell the user's mistakes from runtime failures:

* :func:`plan` does every check that needs no model (plugins built with their options, the
  dataset loaded, its columns checked, the output prepared) and raises :class:`SetupError`
  subclasses (:class:`~batchgen.config.ConfigError`, :class:`~batchgen.dataset.DataError`,
  :class:`~batchgen.output.OutputError`, :class:`~batchgen.plugins.PluginError`) for problems
  the user must fix: exit status 2.
* :func:`execute` loads the model and generates; anything it raises is a runtime failure
  (exit status 1). It still writes a summary with ``"status": "failed"`` (or
  ``"interrupted"``), and every line already in the JSONL stays valid, so ``--resume`` picks up
  where it stopped.

Records are written in finish order, one per dataset row, each as soon as it is final; rows whose
prompt cannot be built are written as error records straight away and never reach the engine.
Lifecycle hooks fire only here, at the edges; the engine's step loop never calls a hook.
"""

from __future__ import annotations

import datetime as _dt
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from batchgen.config import ConfigError, ConfigIssue, GenerationSection, MetricRef, RunConfig, resolved_dict
from batchgen.dataset import DataError, LoadedData, PromptBuilder, PromptRecord, check_columns, iter_prompts, load_rows
from batchgen.output import JsonlWriter, OutputError, check_writable, prepare_output, read_records, write_json_atomic
from batchgen.progress import Progress

__all__ = ["Job", "RunFailed", "SETUP_ERRORS", "build_params", "execute", "plan", "run"]


class RunFailed(Exception):
    """The run started but could not finish (exit status 1)."""


def _plugin_error_type() -> type[Exception]:
    from batchgen.plugins import PluginError

    return PluginError


#: Exceptions that mean "fix your config or inputs" (exit status 2).
SETUP_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, OutputError, _plugin_error_type())


@dataclass
class Job:
    """Everything :func:`execute` needs, checked and ready (see :func:`plan`)."""

    config: RunConfig
    registry: Any
    data: LoadedData
    metrics: list[tuple[MetricRef, Any]]
    logits_processors: list[Any]
    done_ids: set[str] = field(default_factory=set)
    config_path: str | None = None

    @property
    def todo(self) -> int:
        """Rows this run still has to write."""
        return sum(1 for i in self.data.ids if i not in self.done_ids)


def build_params(gen: GenerationSection, logits_processors: Sequence[Any] = ()) -> Any:
    """The engine parameters for one record: SamplingParams (greedy, sample) or BeamSearchParams."""
    from batchgen.sampling.params import BeamSearchParams, SamplingParams

    common: dict[str, Any] = dict(
        max_tokens=gen.max_tokens,
        min_tokens=gen.min_tokens,
        stop=list(gen.stop),
        stop_token_ids=list(gen.stop_token_ids),
        ignore_eos=gen.ignore_eos,
    )
    if gen.mode == "beam":
        return BeamSearchParams(
            beam_width=gen.beam_width,
            length_penalty=gen.length_penalty,
            early_stopping=gen.early_stopping,
            **common,
        )
    sampling: dict[str, Any] = dict(
        presence_penalty=gen.presence_penalty,
        frequency_penalty=gen.frequency_penalty,
        repetition_penalty=gen.repetition_penalty,
        logprobs=gen.logprobs,
        logits_processors=list(logits_processors),
    )
    if gen.mode == "greedy":
        return SamplingParams(n=1, temperature=0.0, **sampling, **common)
    return SamplingParams(
        n=gen.n,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        min_p=gen.min_p,
        **sampling,
        **common,
    )


def plan(
    config: RunConfig,
    registry: Any = None,
    *,
    prepare: bool = True,
    config_path: str | None = None,
) -> Job:
    """Check everything that needs no model and return a ready :class:`Job`.

    With ``prepare=False`` (``batchgen validate``) the output is only checked for writability and
    left untouched; otherwise it is created, truncated (overwrite) or repaired (resume) per
    ``config.output.if_exists``, and the ids already in it are skipped.

    Raises:
        one of :data:`SETUP_ERRORS`.
    """
    if registry is None:
        from batchgen.plugins import load_registry

        registry = load_registry(config.plugins)
    metrics = [(ref, registry.build_metric(ref.name, ref.options)) for ref in config.metrics]
    processors = []
    if config.generation.sampler is not None:
        sampler = config.generation.sampler
        processors.append(registry.build_sampler(sampler.name, sampler.options))
    try:
        build_params(config.generation, processors)
    except ValueError as exc:  # the schema mirrors the engine's checks; this is a backstop
        raise ConfigError([ConfigIssue("generation", str(exc))]) from None
    from batchgen.models import ModelNotFoundError, resolve_model

    try:
        # Cheap for folders and hub ids; converts the embedded GGUF the first time only.
        resolve_model(config.model.name)
    except ModelNotFoundError as exc:
        raise ConfigError([ConfigIssue("model.name", str(exc))]) from None
    from batchgen.executor import check_executor

    check_executor(config)  # backend 'ray' without Ray installed: say what to install
    data = load_rows(config.data)
    required = {ref.key: tuple(getattr(metric, "required_columns", ()) or ()) for ref, metric in metrics}
    check_columns(data.columns, config, required)
    check_writable(config.output.path)
    check_writable(config.output.summary_file)
    done: set[str] = set()
    if prepare:
        done = prepare_output(config.output.path, config.output.if_exists)
    return Job(config, registry, data, metrics, processors, done, config_path)


# --------------------------------------------------------------------------- records


def _generation(completion: Any, beam: bool, with_logprobs: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "index": completion.index,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "cumulative_logprob": completion.cumulative_logprob,
        "num_tokens": len(completion.token_ids),
    }
    if beam:
        entry["score"] = completion.score
    if with_logprobs:
        entry["logprobs"] = completion.logprobs
    return entry


def make_record(prompt: PromptRecord, output: Any | None, config: RunConfig) -> dict[str, Any]:
    """The JSONL record of one row (see docs/config.md, "Output records").

    ``output`` is the engine's RequestOutput, or None for a row that never reached the engine.
    """
    usage = {
        "prompt_tokens": len(prompt.prompt_token_ids or ()),
        "generated_tokens": 0,
        "cached_tokens": 0,
    }
    generations: list[dict[str, Any]] = []
    error = prompt.error
    if output is not None:
        stats = output.stats
        usage = {
            "prompt_tokens": stats.num_prompt_tokens or len(output.prompt_token_ids or ()),
            "generated_tokens": stats.num_generated_tokens,
            "cached_tokens": stats.num_cached_tokens,
        }
        error = output.error
        beam = config.generation.mode == "beam"
        with_logprobs = config.generation.logprobs is not None
        if beam:
            # Best beam first, indexed by rank, so that "the first generation" means the same
            # thing (the model's best answer) in every mode.
            ranked = sorted(output.outputs, key=lambda c: -c.score if c.score is not None else float("inf"))
            generations = [_generation(c, True, False) | {"index": rank} for rank, c in enumerate(ranked)]
        else:
            completions = sorted(output.outputs, key=lambda c: c.index)
            generations = [_generation(c, False, with_logprobs) for c in completions]
    return {
        "id": prompt.id,
        "index": prompt.index,
        "prompt": prompt.prompt,
        "generations": generations,
        "metrics": {},
        "error": error,
        "usage": usage,
    }


def _score(job: Job, record: dict[str, Any], row: dict[str, Any]) -> None:
    """Fill ``record["metrics"]``; a failing metric sets the record's error, keeping generations."""
    if record["error"] is not None:
        return
    plugin_error = _plugin_error_type()
    for ref, metric in job.metrics:
        try:
            record["metrics"][ref.key] = metric.score(record, row)
        except plugin_error as exc:
            record["error"] = str(exc)
            return


# --------------------------------------------------------------------------- run


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("batchgen", "torch", "transformers", "datasets", "pydantic", "pluggy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _aggregate(job: Job) -> tuple[dict[str, Any], dict[str, int]]:
    """Aggregate every metric over the ok records of the whole file (resumed ones included)."""
    counts = {"total": 0, "ok": 0, "error": 0}
    per_metric: dict[str, list[dict[str, Any]]] = {ref.key: [] for ref, _ in job.metrics}
    for record in read_records(job.config.output.path):
        counts["total"] += 1
        if record.get("error") is not None:
            counts["error"] += 1
            continue
        counts["ok"] += 1
        for key, scores in per_metric.items():
            value = (record.get("metrics") or {}).get(key)
            if isinstance(value, dict):
                scores.append(value)
    aggregated = {ref.key: metric.aggregate(per_metric[ref.key]) for ref, metric in job.metrics}
    return aggregated, counts


def execute(job: Job, *, quiet: bool = False, llm: Any = None, executor: Any = None) -> dict[str, Any]:
    """Generate every remaining row, write records and the summary; return the summary.

    ``llm`` may be passed to reuse a loaded engine, or ``executor`` a started executor (left
    running); otherwise the executor that ``executor:`` asks for is built from ``engine`` and
    ``model`` (see :mod:`batchgen.executor`) and stopped at the end. Raises :class:`RunFailed`
    (or ``KeyboardInterrupt``) after writing a summary whose ``status`` says what happened.
    """
    config = job.config
    started, t0 = _now(), time.perf_counter()
    resolved = resolved_dict(config)
    summary: dict[str, Any] = {
        "status": "running",
        "output": str(config.output.path),
        "config_file": job.config_path,
        "config": resolved,
        "versions": _versions(),
        "started_at": started,
    }
    timings: dict[str, float] = {}
    new_records = {"ok": 0, "error": 0}
    plugin_error = _plugin_error_type()
    from batchgen.executor import ExecutorError, make_executor

    owned = executor is None
    executor = executor or make_executor(config, llm)
    # A reused engine has counted earlier work; throughput covers this run only.
    before = executor.stats() or {}
    try:
        job.registry.notify("batchgen_run_start", config=resolved)
        if job.todo and executor.tokenizer is None:  # nothing left (a finished run resumed): skip the model
            t = time.perf_counter()
            executor.start()
            timings["load_model_s"] = time.perf_counter() - t
        t_gen = time.perf_counter()
        if job.todo:
            _generate(job, executor, quiet, new_records)
        timings["generate_s"] = time.perf_counter() - t_gen
        metrics, counts = _aggregate(job)
        summary["status"] = "completed"
        summary["metrics"] = metrics
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except (RunFailed, ExecutorError, plugin_error) as exc:
        summary["status"] = "failed"
        summary["error"] = str(exc)
        raise RunFailed(str(exc)) from exc
    except Exception as exc:
        summary["status"] = "failed"
        summary["error"] = f"{type(exc).__name__}: {exc}"
        raise RunFailed(summary["error"]) from exc
    finally:
        if summary["status"] != "completed":
            counts = {"total": len(job.done_ids) + sum(new_records.values())}
        summary["finished_at"] = _now()
        timings["total_s"] = time.perf_counter() - t0
        summary["timings"] = timings
        summary["records"] = {
            **counts,
            "dataset_rows": len(job.data),
            "resumed": len(job.done_ids),
            "this_run": sum(new_records.values()),
            "this_run_ok": new_records["ok"],
            "this_run_error": new_records["error"],
        }
        stats = executor.stats()
        summary["engine"] = stats
        summary["executor"] = executor.describe()
        summary["throughput"] = _throughput(stats, before, timings, sum(new_records.values()))
        try:
            write_json_atomic(config.output.summary_file, summary)
        finally:
            if owned:
                executor.close()  # stops the replicas, on Ctrl-C too
    job.registry.notify("batchgen_run_end", summary=summary)
    return summary


def _generate(job: Job, llm: Any, quiet: bool, new_records: dict[str, int]) -> None:
    """Stream every remaining row through ``llm`` (an executor), writing each record as it finishes."""
    config = job.config
    builder = PromptBuilder(config.prompt, llm.tokenizer, llm.max_model_len, config.generation.max_tokens)
    params = build_params(config.generation, job.logits_processors)
    tokens_per_record = config.generation.max_tokens * config.generation.num_outputs
    pending: dict[str, PromptRecord] = {}
    with JsonlWriter(config.output.path) as writer, Progress(
        job.todo, tokens_per_record, enabled=False if quiet else None
    ) as progress:

        def finish(prompt: PromptRecord, output: Any | None) -> None:
            record = make_record(prompt, output, config)
            _score(job, record, prompt.row)
            writer.write(record)
            new_records["error" if record["error"] is not None else "ok"] += 1
            progress.record_finished(record["usage"]["generated_tokens"], record["error"] is not None)
            job.registry.notify("batchgen_record_finished", record=record)

        def requests() -> Iterator[Any]:
            from batchgen.engine.llm import Request

            for prompt in iter_prompts(job.data, builder, job.done_ids):
                if prompt.error is not None:
                    finish(prompt, None)
                    continue
                pending[prompt.id] = prompt
                yield Request(prompt.id, prompt.prompt_token_ids or prompt.prompt, params)

        for output in llm.stream(requests(), on_tokens=progress.on_tokens):
            prompt = pending.pop(output.request_id, None)
            if prompt is None:
                raise RunFailed(f"the engine returned an unknown request id {output.request_id!r}")
            finish(prompt, output)
    if pending:
        raise RunFailed(f"the engine finished without returning {len(pending)} request(s), e.g. {next(iter(pending))!r}")


def _throughput(
    stats: dict[str, Any] | None, before: dict[str, Any], timings: dict[str, float], records: int
) -> dict[str, float | int]:
    """Tokens and records per second of generation wall time (model loading excluded).

    ``before`` holds the engine's counters at the start of the run (empty for a new engine).
    """
    seconds = timings.get("generate_s") or max(timings.get("total_s", 0.0) - timings.get("load_model_s", 0.0), 0.0)

    def counted(key: str) -> int:
        return int((stats or {}).get(key, 0)) - int(before.get(key, 0))

    prompt_tokens = counted("num_prompt_tokens")
    generated = counted("num_generated_tokens")
    prefill = counted("num_prefill_tokens")  # computed: prefix-cache hits are not
    rate = (lambda n: n / seconds if seconds > 0 else 0.0)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill,
        "generated_tokens": generated,
        "prompt_tokens_per_s": rate(prompt_tokens),
        "prefill_tokens_per_s": rate(prefill),
        "generated_tokens_per_s": rate(generated),
        "records_per_s": rate(records),
    }


def run(config: RunConfig, registry: Any = None, *, quiet: bool = False, config_path: str | None = None) -> dict[str, Any]:
    """:func:`plan` then :func:`execute`; the library entry point behind ``batchgen run``."""
    return execute(plan(config, registry, config_path=config_path), quiet=quiet)


def summary_path(config: RunConfig) -> Path:
    """Where the run summary of ``config`` is written."""
    return config.output.summary_file

