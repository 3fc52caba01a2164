"""``batchgen batch`` (OpenAI Batch API files): the file machinery alone, and W32 end to end.

Two parts, each run in fresh worker processes:

* ``stream``: batch files of several sizes (a realistic mix of chat and completions lines,
  about 1 % of them bad) through ``plan`` + ``execute``, the path ``batchgen batch`` takes, on
  an *instant engine*: the real SmolLM2 tokenizer and chat template, no model. It reads
  requests ahead as ``LLM.stream`` does (``max_num_seqs`` at a time) and answers each at once
  with a fixed completion. What is timed is parsing and validating each line, the chat template
  and tokenization, the request stream, building the OpenAI response lines and writing them
  (fsync included). Reported: lines/s, and the process's resident memory sampled every 50 ms
  against the lines answered, with the peak; memory must not grow with the file.
* ``w32``: W32 (32 chat prompts, greedy, ``max_tokens`` 64, SmolLM2-135M-Instruct fp32, one
  torch thread) as a batch file of chat lines against the same job through ``batchgen run``
  (a dataset of the same templated prompts), alternating A B A B in fresh processes. Tokens/s
  is the engine's generated tokens over the generation wall time, as the run summary reports.

::

    python -m bench.openai_batch stream --sizes 5000x3,20000x3,80000 --per-line-sizes 5000x3
    python -m bench.openai_batch w32 --repeats 3
    python -m bench.openai_batch report          # the plot, from the committed JSON

This module is the driver (the parts, the report, the command line); what each worker process
runs is in ``bench/openai_batch_workers.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.openai_batch_workers import make_batch_file, stream_worker, w32_files, w32_worker

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
STREAM_JSON = RESULTS / "openai_batch_stream.json"
W32_JSON = RESULTS / "openai_batch_w32.json"

# --------------------------------------------------------------------------- driver


def _spawn(args: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "bench.openai_batch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    result = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT ")]
    if proc.returncode != 0 or not result:
        raise RuntimeError(f"worker {args[:2]} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(result[-1][len("@@RESULT "):])


def _machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _sizes(spec: str) -> list[tuple[int, int]]:
    """``"5000x3,80000"`` -> ``[(5000, 3), (80000, 1)]`` (size, repeats)."""
    pairs = []
    for item in filter(None, spec.split(",")):
        size, _, times = item.partition("x")
        pairs.append((int(size), int(times or 1)))
    return pairs


def part_stream(sizes: list[tuple[int, int]], per_line: list[tuple[int, int]], out: Path, timeout: float) -> dict[str, Any]:
    """Each (size, mode) run ``repeats`` times, the repeats of all of them interleaved."""
    result: dict[str, Any] = {"machine": _machine(), "engine": "instant (tokenizer and chat template real, no model)",
                              "runs": [], "per_line_fsync_runs": []}
    plan_ = [(size, times, "runs") for size, times in sizes] + [(size, times, "per_line_fsync_runs") for size, times in per_line]
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {}
        for size, _, _ in plan_:
            source = Path(tmp) / f"in_{size}.jsonl"
            if not source.exists():
                kinds[size] = make_batch_file(source, size)
        for repeat in range(max(times for _, times, _ in plan_)):
            for size, times, key in plan_:
                if repeat >= times:
                    continue
                source = Path(tmp) / f"in_{size}.jsonl"
                extra = ["--per-line-fsync"] if key != "runs" else []
                run = _spawn(["worker-stream", str(source), str(Path(tmp) / f"out_{size}.jsonl"), *extra], timeout)
                run.update(size=size, repeat=repeat, kinds=kinds[size], input_bytes=source.stat().st_size)
                print(f"{size} lines ({run['fsync']}): {run['lines_per_s']:.0f} lines/s, RSS "
                      f"{run['rss_baseline_mib']:.1f} -> peak {run['rss_peak_sampled_mib']:.1f} MiB", flush=True)
                result[key].append(run)
    table = {}
    for key in ("runs", "per_line_fsync_runs"):
        for size in sorted({r["size"] for r in result[key]}):
            rates = [r["lines_per_s"] for r in result[key] if r["size"] == size]
            growth = [r["rss_peak_sampled_mib"] - r["rss_baseline_mib"] for r in result[key] if r["size"] == size]
            table[f"{size} {result[key][0]['fsync']}"] = {
                "repeats": len(rates), "lines_per_s_median": statistics.median(rates),
                "lines_per_s_min": min(rates), "lines_per_s_max": max(rates), "rss_growth_mib_max": max(growth)}
    result["summary"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def part_w32(repeats: int, out: Path, timeout: float, merge: bool = False) -> dict[str, Any]:
    """``repeats`` pairs of runs, the order alternating by repeat; ``merge`` adds them to ``out``."""
    result: dict[str, Any] = {"machine": _machine(), "workload": "W32, greedy, max_tokens 64, SmolLM2-135M fp32, 1 thread",
                              "runs": []}
    if merge and out.exists():
        result["runs"] = json.loads(out.read_text())["runs"]
    first = len(result["runs"]) // 2
    with tempfile.TemporaryDirectory() as tmp:
        batch, rows = w32_files(Path(tmp))
        for r in range(first, first + repeats):
            order = [("run", rows), ("batch", batch)]
            for kind, source in (order if r % 2 == 0 else order[::-1]):
                run = _spawn(["worker-w32", kind, str(source), str(Path(tmp) / f"{kind}.jsonl")], timeout)
                run["repeat"] = r
                print(f"repeat {r} {kind}: {run['tokens_per_s']:.1f} tok/s ({run['generated_tokens']} tokens)", flush=True)
                result["runs"].append(run)
    runs = result["runs"]
    for run in runs:  # keep one copy of the texts, and whether every run gave the same
        run["texts_sha"] = run.pop("texts_sha", None) or _sha(run.pop("texts"))
    same = len({run["texts_sha"] for run in runs}) == 1
    per = {k: [x["tokens_per_s"] for x in runs if x["kind"] == k] for k in ("run", "batch")}
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[0::2], runs[1::2])]
    ratios = [q if runs[2 * i]["kind"] == "run" else 1 / q for i, q in enumerate(ratios)]
    result["summary"] = {
        "same_texts": same,
        "run_tokens_per_s_median": statistics.median(per["run"]),
        "batch_tokens_per_s_median": statistics.median(per["batch"]),
        "batch_over_run_per_repeat": ratios,
        "batch_over_run_median": statistics.median(ratios),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _sha(texts: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(texts, sort_keys=True).encode()).hexdigest()[:16]


def report(stream: Path = STREAM_JSON, png: Path | None = None) -> None:
    """Resident memory above the run's starting point against lines answered, one curve per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(stream.read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in (r for r in data["runs"] if r.get("repeat", 0) == 0):
        xs = [s[1] for s in run["rss_samples"]]
        ys = [s[2] - run["rss_baseline_mib"] for s in run["rss_samples"]]
        ax.plot(xs, ys, label=f"{run['size']:,} lines: {run['lines_per_s']:,.0f} lines/s, "
                f"peak +{run['rss_peak_sampled_mib'] - run['rss_baseline_mib']:.1f} MiB")
    largest = max(data["runs"], key=lambda r: r["size"])
    ax.text(0.02, 0.95, f"the {largest['size']:,}-line file: input {largest['input_bytes'] / 2**20:.0f} MiB, "
            f"output {largest['output_bytes'] / 2**20:.0f} MiB\n(a runner that holds the file and its answers in "
            "memory grows by at least that much)", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xlabel("lines answered")
    ax.set_ylabel("resident memory above the start (MiB)")
    ax.set_ylim(-1, 10)
    ax.set_title("batchgen batch on an instant engine: memory stays flat")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png or stream.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.openai_batch", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    s = sub.add_parser("stream")
    s.add_argument("--sizes", default="5000x3,20000x3,80000", help="sizes, each SIZExREPEATS (default 1 repeat)")
    s.add_argument("--per-line-sizes", default="5000x3", help="also run these with one fsync per line ('' for none)")
    s.add_argument("--out", type=Path, default=STREAM_JSON)
    w = sub.add_parser("w32")
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--out", type=Path, default=W32_JSON)
    w.add_argument("--merge", action="store_true", help="add the runs to those already in --out")
    sub.add_parser("report")
    ws = sub.add_parser("worker-stream")
    ws.add_argument("source")
    ws.add_argument("output")
    ws.add_argument("--per-line-fsync", action="store_true")
    ww = sub.add_parser("worker-w32")
    ww.add_argument("kind", choices=["run", "batch"])
    ww.add_argument("source")
    ww.add_argument("output")
    for p in (s, w):
        p.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.part == "stream":
        part_stream(_sizes(args.sizes), _sizes(args.per_line_sizes), args.out, args.timeout)
        report(args.out)
    elif args.part == "w32":
        part_w32(args.repeats, args.out, args.timeout, args.merge)
    elif args.part == "report":
        report()
    elif args.part == "worker-stream":
        print("@@RESULT " + json.dumps(stream_worker(args.source, args.output, args.per_line_fsync)), flush=True)
    else:
        print("@@RESULT " + json.dumps(w32_worker(args.kind, args.source, args.output)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
