"""Scale-out: ``batchgen run`` on one engine against Ray replicas, and the driver's ceiling.

* **Runs** (W256 greedy, ``max_tokens`` 32, the default engine settings), each a whole
  ``batchgen run`` in its own process, as a user runs it: local at 1 and 2 torch threads
  (``OMP_NUM_THREADS``), and the Ray executor with 1 and 2 replicas of 1 thread each (a local Ray
  started by the run). Repeats are interleaved, their order rotated per repeat. Figures come from
  each run's summary: generated tokens/s over the generation wall time, the model load or the Ray
  start-up (``ray.init``, then the replicas loading), and the whole process's wall time.
* **Driver ceiling**: the pipeline (records built, scored, written and fsync-ed one by one by the
  single writer) fed by replicas whose engine is :class:`FakeEngine`, which finishes every
  request at once: records/s through the driver, for 1, 2 and 4 replicas.

``python -m bench --parts scaleout`` runs both; ``--scaleout-only runs|ceiling`` one of them;
``--merge`` adds the runs to an existing ``scaleout.json`` (for repeats in separate sittings).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import runner
from bench.workload import USER_TURN, VARIANT_OPENINGS, load_w32

CONFIGS = {
    "local_1t": {"threads": 1, "executor": {"backend": "local"}},
    "local_2t": {"threads": 2, "executor": {"backend": "local"}},
    "ray_1x1t": {"threads": 1, "executor": {"backend": "ray", "replicas": 1,
                                            "resources_per_replica": {"num_cpus": 1}}},
    "ray_2x1t": {"threads": 1, "executor": {"backend": "ray", "replicas": 2,
                                            "resources_per_replica": {"num_cpus": 1}}},
}


# --------------------------------------------------------------------------- the fake engine


def fake_engine(engine: dict[str, Any]) -> FakeEngine:
    """Engine factory for :class:`batchgen.run.executors.ray.RayExecutor`: an instant engine."""
    return FakeEngine(engine)


class FakeEngine:
    """Finishes every queued request at its next step with ``max_tokens`` tokens (no model)."""

    max_model_len = 8192

    def __init__(self, engine: dict[str, Any]) -> None:
        self.pending: list[Any] = []
        self.prompt_tokens = self.generated = self.steps = 0

    def add_request(self, request: Any) -> None:
        self.pending.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> tuple[list[Any], int]:
        from batchgen.engine.outputs import CompletionOutput, RequestOutput
        from batchgen.engine.sequence import RequestStats

        outputs, tokens = [], 0
        for request in self.pending:
            n = request.params.max_tokens
            prompt = list(request.prompt)
            stats = RequestStats(num_prompt_tokens=len(prompt), num_generated_tokens=n)
            outputs.append(RequestOutput(request.request_id, None, prompt, stats=stats, outputs=[
                CompletionOutput(0, "x" * n, [0] * n, -1.0, finish_reason="length")]))
            tokens += n
            self.prompt_tokens += len(prompt)
        self.pending = []
        self.generated += tokens
        self.steps += 1
        return outputs, tokens

    def stats(self) -> dict[str, Any]:
        return {"num_blocks": 1, "block_size": 16, "kv_cache_bytes": 0, "peak_blocks_used": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "num_cow_copies": 0,
                "num_prompt_tokens": self.prompt_tokens, "num_generated_tokens": self.generated,
                "num_prefill_tokens": self.prompt_tokens, "num_steps": self.steps, "physical_blocks": 0,
                "logical_blocks": 0}


# --------------------------------------------------------------------------- runs


def w256_rows() -> list[dict[str, Any]]:
    """W256 as dataset rows: the chat-templated text of each prompt (see bench.workload)."""
    rows = []
    for v, opening in enumerate(VARIANT_OPENINGS):
        for r in load_w32():
            rows.append({"id": f"v{v}-{r['index']}", "prompt": r["text"].replace(USER_TURN, USER_TURN + opening, 1)})
    return rows


def job_yaml(folder: Path, name: str, data: Path, max_tokens: int, executor: dict[str, Any]) -> Path:
    config = {
        "data": {"source": str(data), "id_column": "id"},
        "prompt": {"column": "prompt", "chat_template": False},  # the text is already templated
        "generation": {"mode": "greedy", "max_tokens": max_tokens},
        "executor": executor,
        "metrics": [{"name": "length"}],
        "output": {"path": str(folder / f"{name}.jsonl"), "if_exists": "overwrite"},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_run(folder: Path, name: str, spec: dict[str, Any], data: Path, max_tokens: int, timeout: float) -> dict:
    """One ``batchgen run`` in a fresh process; its figures from the summary."""
    job = job_yaml(folder, name, data, max_tokens, spec["executor"])
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(runner.REPO))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"], cwd=runner.REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"config": name, "error": proc.stderr[-3000:]}
    summary = json.loads((folder / f"{name}.summary.json").read_text())
    tp, timings, executor = summary["throughput"], summary["timings"], summary["executor"]
    return {
        "config": name, "wall_s": wall, "generate_s": tp["seconds"], "load_s": timings.get("load_model_s"),
        "generated_tokens": tp["generated_tokens"], "tokens_per_s": tp["generated_tokens_per_s"],
        "records": summary["records"]["this_run"], "records_per_s": tp["records_per_s"],
        "startup_s": executor.get("startup_s"),
        "per_replica": [{k: r.get(k) for k in ("records", "generated_tokens", "tokens_per_s", "threads",
                                               "preemptions", "kv_peak_fraction")} for r in executor["per_replica"]],
        "texts_digest": digest(folder / f"{name}.jsonl"),
    }


def digest(path: Path) -> str:
    """A digest of the generated texts by id, to check that every configuration wrote the same."""
    import hashlib

    texts = sorted((r["id"], [g["text"] for g in r["generations"]])
                   for r in map(json.loads, path.read_text().splitlines()))
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]


def summarize(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for name in CONFIGS:
        ok = [r for r in runs if r["config"] == name and "tokens_per_s" in r]
        if not ok:
            continue
        tps = [r["tokens_per_s"] for r in ok]
        out[name] = {"runs": len(ok), "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps), "wall_s_median": statistics.median(r["wall_s"] for r in ok),
                     "load_s_median": statistics.median(r["load_s"] or 0 for r in ok)}
        startups = [r["startup_s"] for r in ok if r.get("startup_s")]
        if startups:
            out[name]["ray_init_s_median"] = statistics.median(s["ray_init_s"] for s in startups)
            out[name]["startup_s_median"] = statistics.median(s["total_s"] for s in startups)
    # Ratios per repeat (runs of one repeat ran back to back) and their spread.
    ratios: dict[str, Any] = {}
    for name in ("local_2t", "ray_1x1t", "ray_2x1t"):
        paired = []
        for rep in sorted({r["repeat"] for r in runs}):
            a = [r for r in runs if r["repeat"] == rep and r["config"] == name and "tokens_per_s" in r]
            b = [r for r in runs if r["repeat"] == rep and r["config"] == "local_1t" and "tokens_per_s" in r]
            if a and b:
                paired.append(a[0]["tokens_per_s"] / b[0]["tokens_per_s"])
        if paired:
            ratios[f"{name}_over_local_1t"] = {"median": statistics.median(paired), "min": min(paired),
                                               "max": max(paired), "all": paired}
    out["ratios"] = ratios
    # Per-record overhead of the Ray path at one replica: extra generation seconds per record.
    one, local = out.get("ray_1x1t"), out.get("local_1t")
    if one and local:
        records = next(r["records"] for r in runs if r["config"] == "ray_1x1t" and "records" in r)
        t_ray = statistics.median(r["generate_s"] for r in runs if r["config"] == "ray_1x1t" and "generate_s" in r)
        t_loc = statistics.median(r["generate_s"] for r in runs if r["config"] == "local_1t" and "generate_s" in r)
        out["ray_overhead_ms_per_record"] = (t_ray - t_loc) / records * 1000
    return out


def part_runs(args: Any, out: Path, log: Any, result: dict) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    data = folder / "w256.jsonl"
    rows = w256_rows()[: args.scaling_prompts]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result["workload"] = f"W{len(rows)} greedy"
    result["max_tokens"] = args.scaling_max_tokens
    first = 1 + max((r["repeat"] for r in result["runs"]), default=-1)
    names = list(CONFIGS)
    for rep in range(first, first + args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            run = one_run(folder, name, CONFIGS[name], data, args.scaling_max_tokens, args.run_timeout * 2)
            run["repeat"] = rep
            run["at"] = time.strftime("%Y-%m-%d %H:%M:%S")
            result["runs"].append(run)
            if "error" in run:
                log(f"  {name} rep {rep}: failed: {run['error'][-400:]}")
            else:
                log(f"  {name} rep {rep}: {run['tokens_per_s']:.1f} tok/s over {run['generate_s']:.1f} s, "
                    f"load {run['load_s']:.1f} s, wall {run['wall_s']:.1f} s")
            result["summary"] = summarize(result["runs"])
            save(out, result, log)


# --------------------------------------------------------------------------- driver ceiling


def driver_ceiling(rows: int, replicas: int, folder: Path) -> dict:
    """Records/s through the driver with ``replicas`` instant engines (the writer's fsync included)."""
    from batchgen.config import validate_config
    from batchgen.run.executors.ray import RayExecutor
    from batchgen.run.execute import execute
    from batchgen.run.plan import plan
    from batchgen.plugins import load_registry

    data = folder / "rows.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Row {i}: say something."}) + "\n"
                                for i in range(rows)))
    config = validate_config({
        "data": {"source": str(data), "id_column": "id"},
        "prompt": {"column": "prompt", "chat_template": False},
        "generation": {"mode": "greedy", "max_tokens": 32},
        "executor": {"backend": "ray", "replicas": replicas, "resources_per_replica": {"num_cpus": 0.25}},
        "metrics": [{"name": "length"}],
        "output": {"path": str(folder / f"ceiling{replicas}.jsonl"), "if_exists": "overwrite"},
    })
    executor = RayExecutor(config, engine_factory=fake_engine)
    executor.start()
    try:
        summary = execute(plan(config, load_registry()), quiet=True, executor=executor)
    finally:
        executor.close()
    return {"replicas": replicas, "rows": rows, "seconds": summary["throughput"]["seconds"],
            "records_per_s": summary["throughput"]["records_per_s"],
            "per_replica_records": [r["records"] for r in summary["executor"]["per_replica"]]}


def writer_ceiling(rows: int, folder: Path) -> dict:
    """Records/s of the JSONL writer alone (one write + fsync per record), for comparison."""
    from batchgen.io.output_file import JsonlWriter

    record = {"id": "r0", "index": 0, "prompt": "Row 0: say something.",
              "generations": [{"index": 0, "text": "x" * 32, "finish_reason": "length", "num_tokens": 32}],
              "metrics": {}, "error": None, "usage": {"prompt_tokens": 8, "generated_tokens": 32}}
    t0 = time.perf_counter()
    with JsonlWriter(folder / "writer.jsonl") as w:
        for i in range(rows):
            w.write({**record, "id": f"r{i}", "index": i})
    return {"rows": rows, "records_per_s": rows / (time.perf_counter() - t0)}


def part_ceiling(args: Any, out: Path, log: Any, result: dict) -> None:
    import logging

    import ray

    rows = args.ceiling_rows
    folder = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        found = {"rows": rows, "writer_alone": writer_ceiling(rows, folder), "runs": []}
        log(f"  JSONL writer alone: {found['writer_alone']['records_per_s']:.0f} records/s")
        for replicas in (1, 2, 4):
            row = driver_ceiling(rows, replicas, folder)
            found["runs"].append(row)
            log(f"  driver, {replicas} instant replica(s): {row['records_per_s']:.0f} records/s")
    finally:
        ray.shutdown()
    result["driver_ceiling"] = found
    save(out, result, log)


def save(out: Path, result: dict, log: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaleout.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
    log(f"wrote {path}")


def part(args: Any, out: Path, log: Any, machine: dict) -> dict:
    """``--parts scaleout``: the runs and the driver ceiling (see the module docstring)."""
    path = out / "scaleout.json"
    result: dict = {"runs": [], "configs": CONFIGS}
    if args.merge and path.is_file():
        result = json.loads(path.read_text())
    result.setdefault("machines", []).append(machine)
    if args.scaleout_only in ("", "runs"):
        log(f"scaleout: W{args.scaling_prompts} greedy, max_tokens {args.scaling_max_tokens}, "
            f"{list(CONFIGS)} x {args.repeats}")
        part_runs(args, out, log, result)
    if args.scaleout_only in ("", "ceiling"):
        log(f"scaleout: driver ceiling over {args.ceiling_rows} rows")
        part_ceiling(args, out, log, result)
    return result


def plot(out: Path, result: dict) -> None:
    """``scaleout.png``: tokens/s per configuration (median, min-max) and the driver's ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.get("summary") or {}
    names = [n for n in CONFIGS if n in summary]
    ceiling = result.get("driver_ceiling")
    fig, axes = plt.subplots(1, 2 if ceiling else 1, figsize=(11 if ceiling else 6, 4), squeeze=False)
    ax = axes[0][0]
    med = [summary[n]["tokens_per_s_median"] for n in names]
    err = [[m - summary[n]["tokens_per_s_min"] for n, m in zip(names, med)],
           [summary[n]["tokens_per_s_max"] - m for n, m in zip(names, med)]]
    ax.bar(range(len(names)), med, yerr=err, capsize=4, color=["#888", "#555", "#6a9fd4", "#1f5fa8"][: len(names)])
    ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{result.get('workload', 'W256')}, max_tokens {result.get('max_tokens')} (median, min-max)")
    if ceiling:
        ax = axes[0][1]
        xs = [r["replicas"] for r in ceiling["runs"]]
        ax.plot(xs, [r["records_per_s"] for r in ceiling["runs"]], "o-", label="driver (instant replicas)")
        ax.axhline(ceiling["writer_alone"]["records_per_s"], color="#999", ls="--", label="JSONL writer alone")
        ax.set_xlabel("instant replicas")
        ax.set_ylabel("records/s")
        ax.set_xticks(xs)
        ax.set_ylim(0, ceiling["writer_alone"]["records_per_s"] * 1.1)
        ax.set_title("The single writer's ceiling")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaleout.png", dpi=120)
    plt.close(fig)


def summary_lines(result: dict | None) -> list[str]:
    """The scaleout section of ``summary.md``."""
    if not result or not result.get("summary"):
        return []
    s = result["summary"]
    lines = [f"## Scale-out ({result.get('workload')}, max_tokens {result.get('max_tokens')}, `batchgen run` per "
             "configuration, repeats interleaved)", "",
             "| configuration | tokens/s (median, min-max) | / local 1 thread (per repeat) | start-up s (Ray init) |",
             "| --- | --- | --- | --- |"]
    for name in CONFIGS:
        if name not in s:
            continue
        r = s[name]
        ratio = s["ratios"].get(f"{name}_over_local_1t")
        shown = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "1"
        start = (f"{r['startup_s_median']:.1f} ({r['ray_init_s_median']:.1f})" if "startup_s_median" in r
                 else f"{r['load_s_median']:.1f} (model load)")
        lines.append(f"| {name} | {r['tokens_per_s_median']:.1f} ({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f})"
                     f" | {shown} | {start} |")
    if "ray_overhead_ms_per_record" in s:
        lines += ["", f"Per-record overhead of Ray (one replica against local, both at one thread): "
                      f"{s['ray_overhead_ms_per_record']:+.1f} ms of generation time per record "
                      "(the difference of the medians; below zero it is within the noise)."]
    ceiling = result.get("driver_ceiling")
    if ceiling:
        best = max(r["records_per_s"] for r in ceiling["runs"])
        lines += ["", f"Driver ceiling (instant replicas, {ceiling['rows']} rows): "
                      + ", ".join(f"{r['replicas']} replica(s) {r['records_per_s']:.0f} records/s" for r in ceiling["runs"])
                      + f"; the JSONL writer alone {ceiling['writer_alone']['records_per_s']:.0f} records/s "
                      f"(best driver figure {best:.0f})."]
    return lines + [""]
