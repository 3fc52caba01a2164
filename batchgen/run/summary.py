"""The run summary: written when a run starts (``"status": "running"``) and again when it ends.

Its counts are read back from the record files (:func:`tally`), not from what the process
believes it wrote, so they are exact whenever the run stopped. ``runs`` keeps one entry per
invocation of a resumed job. See docs/config.md, "Run summary", for every field.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

import datetime as _dt
import platform
import signal
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from batchgen.run.failures import Reasons
from batchgen.run.fingerprint import fingerprint_hash
from batchgen.run.plan import Job
from batchgen.io.output_file import OutputError, OutputWriteError, read_records, write_json_atomic

__all__ = ["Summary", "tally", "throughput"]


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


def signal_name(signum: int | None) -> str:
    """``SIGTERM`` for 15 (``SIGINT`` when not known)."""
    try:
        return signal.Signals(signum if signum is not None else signal.SIGINT).name
    except ValueError:
        return str(signum)


def tally(job: Job, with_metrics: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Count the records of the whole file (resumed ones included) and, if asked, aggregate
    every metric over the ok ones. Returns ``(records, metrics)``; ``records`` holds
    ``output_tokens`` (this run's), ``first_error`` (a ``describe_error``), ``error_reasons``
    (the most common reasons, :class:`~batchgen.run.failures.Reasons`) and ``metric_rows`` (per
    metric key, the ok records it scored) besides the counts.
    """
    counts: dict[str, Any] = {"total": 0, "ok": 0, "error": 0, "this_run": 0, "this_run_ok": 0, "this_run_error": 0}
    output_tokens = 0
    first_error = None
    reasons = Reasons()
    per_metric: dict[str, list[dict[str, Any]]] = {ref.key: [] for ref, _ in job.metrics}
    kind, answered = job.records, job.answered
    keyless_done = answered.keyless  # answered in input order: the first ones are old
    for record in (r for path in job.outputs if Path(path).exists() for r in read_records(path)):
        failed = kind.failed(record)
        key = kind.key(record)
        if key is None:
            new, keyless_done = keyless_done <= 0, keyless_done - 1
        else:
            new = key not in answered
        counts["total"] += 1
        counts["error" if failed else "ok"] += 1
        if new:
            counts["this_run"] += 1
            counts["this_run_error" if failed else "this_run_ok"] += 1
            output_tokens += kind.output_tokens(record)
        if failed:
            described = kind.describe_error(record)
            first_error = first_error or described
            reasons.add(str(described.get("error")), described)
            continue
        for key, scores in per_metric.items():
            value = (record.get("metrics") or {}).get(key)
            if isinstance(value, dict):
                scores.append(value)
    counts["output_tokens"] = output_tokens
    if first_error is not None:
        counts["first_error"] = first_error
        counts["error_reasons"] = reasons.most_common()
    # A metric covers the ok records it gave a value (None is "does not apply", e.g. no answer).
    counts["metric_rows"] = {key: sum(1 for s in scores if any(v is not None for v in s.values()))
                             for key, scores in per_metric.items()}
    metrics = {ref.key: metric.aggregate(per_metric[ref.key]) for ref, metric in job.metrics} if with_metrics else {}
    return counts, metrics


def throughput(
    stats: dict[str, Any] | None,
    before: dict[str, Any],
    timings: dict[str, float],
    records: int,
    output_tokens: int = 0,
) -> dict[str, float | int]:
    """Tokens and records per second of generation wall time (model loading excluded).

    ``before`` holds the engine's counters at the start of the run (empty for a new engine).
    ``generated_tokens`` is the engine's count: every token it sampled, for beam search every
    live beam's token at every step (pruned beams included), and the EOS that ends a sequence.
    ``output_tokens`` is what the records keep (the format's ``output_tokens`` summed).
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
        "output_tokens": output_tokens,
        "prompt_tokens_per_s": rate(prompt_tokens),
        "prefill_tokens_per_s": rate(prefill),
        "generated_tokens_per_s": rate(generated),
        "output_tokens_per_s": rate(output_tokens),
        "records_per_s": rate(records),
    }


def _run_entry(summary: dict[str, Any]) -> dict[str, Any]:
    """One invocation's line in the summary's ``runs`` history."""
    records = summary.get("records") or {}
    return {
        "started_at": summary.get("started_at"),
        "finished_at": summary.get("finished_at"),
        "status": summary.get("status"),
        "records": {k: records.get(k) for k in ("this_run", "this_run_ok", "this_run_error")},
        "timings": summary.get("timings"),
        "throughput": summary.get("throughput"),
    }


def _history(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ``runs`` of the summary this run resumes (a summary without one counts as one run)."""
    if not previous:
        return []
    runs = previous.get("runs")
    if isinstance(runs, list):
        return [r for r in runs if isinstance(r, dict)]
    return [_run_entry(previous)]


class Summary:
    """The summary of one run of ``job``: :attr:`data` is what is written.

    :meth:`start` writes it with ``"status": "running"`` (so that a run killed by SIGKILL leaves
    its config and its own entry in ``runs`` behind); :meth:`finish` fills in the counts,
    timings, throughput and history and writes it again.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.history = _history(job.previous)
        self.data: dict[str, Any] = {
            "status": "running",
            "output": str(job.config.output.path),
            "config_file": job.config_path,
            "config": job.resolved,
            "fingerprint": fingerprint_hash(job.resolved),
            "versions": _versions(),
            "started_at": _now(),
        }

    def start(self) -> None:
        """Write the summary of a run that has started (raises OutputWriteError)."""
        write_json_atomic(self.job.config.output.summary_file, self.data | {"runs": [*self.history, _run_entry(self.data)]})

    def write(self) -> str | None:
        """Write :attr:`data`; None, or why the summary could not be written."""
        try:
            write_json_atomic(self.job.config.output.summary_file, self.data)
        except OutputWriteError as exc:
            return str(exc)
        return None

    def finish(self, executor: Any, before: dict[str, Any], new_records: dict[str, int],
               tallied: tuple[dict[str, Any], dict[str, Any]] | None) -> str | None:
        """Fill in counts, timings, throughput and history, and write the summary.

        ``tallied`` is the completed run's :func:`tally`; a run that stopped early is counted
        here. ``new_records`` (``ok``/``error`` this process wrote) is the fallback when the
        file cannot be read back. Returns None, or why the summary could not be written.
        """
        job, summary, timings = self.job, self.data, self.timings
        try:
            counts = dict(tallied[0]) if tallied is not None else tally(job, with_metrics=False)[0]
        except (OutputError, OSError) as exc:
            # The file cannot be read back (it is damaged or gone): fall back on this run's counts.
            written = sum(new_records.values())
            counts = {"total": len(job.answered) + written, "this_run": written, "this_run_ok": new_records["ok"],
                      "this_run_error": new_records["error"], "output_tokens": 0}
            summary.setdefault("error", f"could not read back {job.config.output.path}: {exc}")
        summary["finished_at"] = _now()
        timings["total_s"] = time.perf_counter() - self.t0
        output_tokens = counts.pop("output_tokens", 0)
        metric_rows = counts.pop("metric_rows", None)
        summary["records"] = {**counts, "dataset_rows": len(job.source), "resumed": len(job.answered)}
        if metric_rows is not None:  # per metric: the rows it covers, the rows that failed
            summary["metric_rows"] = {key: {"rows": n, "failed": counts.get("error", 0)} for key, n in metric_rows.items()}
        summary.update(job.records.summary_counts(counts))
        stats = executor.stats()
        summary["executor"] = executor.describe()
        speed = throughput(stats, before, timings, counts.get("this_run", 0), output_tokens)
        if job.scoring is not None:  # nothing is generated: the prompt tokens are what is scored
            speed |= {"scored_tokens": speed["prompt_tokens"], "scored_tokens_per_s": speed["prompt_tokens_per_s"]}
        previous = job.previous or {}
        if counts.get("this_run", 0) == 0 and previous.get("throughput"):
            # Nothing was generated (a finished run resumed): keep the figures of the run that did
            # the work; this run's own are in ``runs``.
            summary["timings"] = previous.get("timings")
            summary["throughput"] = previous.get("throughput")
            summary["engine"] = previous.get("engine")
        else:
            summary["timings"] = timings
            summary["throughput"] = speed
            summary["engine"] = stats
        summary["runs"] = [*self.history, _run_entry(summary) | {"timings": timings, "throughput": speed}]
        return self.write()
