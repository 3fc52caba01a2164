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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
STREAM_JSON = RESULTS / "openai_batch_stream.json"
W32_JSON = RESULTS / "openai_batch_w32.json"

TOPICS = ["the French revolution", "photosynthesis", "binary search", "the water cycle", "volcanoes",
          "compound interest", "the immune system", "black holes", "supply and demand", "plate tectonics"]
STYLES = ["Keep it short.", "Explain it to a ten-year-old.", "Use three bullet points.", "Give one example.",
          "Answer in two sentences, then add a fun fact about it that most people do not know."]


# --------------------------------------------------------------------------- workload


def make_batch_file(path: Path, num_lines: int, seed: int = 0) -> dict[str, int]:
    """Write ``num_lines`` request lines: chat and completions, varied parameters, ~1 % bad."""
    rng = random.Random(seed)
    kinds: dict[str, int] = {}
    with open(path, "w") as f:
        for i in range(num_lines):
            roll = rng.random()
            topic, style = rng.choice(TOPICS), rng.choice(STYLES)
            if roll < 0.005:
                kind, text = "bad_json", '{"custom_id": "broken-%d", "method": "POST", ' % i
            elif roll < 0.01:
                kind = "duplicate"
                text = json.dumps({"custom_id": f"request-{max(i - 10, 0)}", "method": "POST",
                                   "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 4}})
            else:
                body: dict[str, Any]
                if roll < 0.6:
                    kind = "chat"
                    body = {"messages": [{"role": "system", "content": "You are a helpful assistant. " + style},
                                         {"role": "user", "content": f"Request {i}: tell me about {topic}."}],
                            "max_tokens": 64}
                    if rng.random() < 0.3:
                        body["temperature"] = 0
                    if rng.random() < 0.1:
                        body["n"] = 2
                    if rng.random() < 0.1:
                        body.update(logprobs=True, top_logprobs=2)
                elif roll < 0.99:
                    kind = "completion"
                    body = {"prompt": f"{style} Here is a note about {topic} (number {i}):", "max_tokens": 32}
                    if rng.random() < 0.1:
                        body["logprobs"] = 1
                else:
                    kind = "beam"
                    body = {"prompt": f"A title for an essay on {topic}:", "max_tokens": 16,
                            "use_beam_search": True, "n": 2}
                url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                text = json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body})
            kinds[kind] = kinds.get(kind, 0) + 1
            f.write(text + "\n")
    return kinds


# --------------------------------------------------------------------------- the instant engine


class InstantEngine:
    """Stands in for ``batchgen.LLM`` with no model: every request is answered at once.

    Requests are read ``max_num_seqs`` at a time (as the engine's lookahead does); each
    completion is ``min(max_tokens, tokens)`` copies of one token, with logprobs when asked.
    """

    def __init__(self, tokenizer: Any, max_model_len: int = 8192, max_num_seqs: int = 256, tokens: int = 16) -> None:
        from batchgen.engine.outputs import CompletionOutput, RequestOutput
        from batchgen.engine.sequence import RequestStats

        self._types = (CompletionOutput, RequestOutput, RequestStats)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.model_name = "instant"
        self.token = tokenizer(" the", add_special_tokens=False)["input_ids"][0]
        self.texts = [tokenizer.decode([self.token] * k) for k in range(tokens + 1)]
        self.tokens = tokens
        self.answered = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def stream(self, requests: Any, on_tokens: Any = None) -> Any:
        source = iter(requests)
        while True:
            batch = list(islice(source, self.max_num_seqs))
            if not batch:
                return
            outputs = [self._answer(r) for r in batch]
            if on_tokens is not None:
                on_tokens(sum(o.stats.num_generated_tokens for o in outputs))
            for out in outputs:
                self.answered += 1
                yield out

    def _answer(self, request: Any) -> Any:
        completion, request_output, request_stats = self._types
        params = request.params
        beam = hasattr(params, "beam_width")
        count = params.beam_width if beam else (params.best_of or params.n)
        k = min(params.max_tokens, self.tokens)
        ids = request.prompt if isinstance(request.prompt, list) else self.tokenizer(request.prompt)["input_ids"]
        logprobs = getattr(params, "logprobs", None)
        outs = []
        for i in range(count if beam else params.n):
            top = None
            if logprobs is not None:
                top = [{self.token: -0.5, **{self.token + j + 1: -1.5 - j for j in range(logprobs)}} for _ in range(k)]
            outs.append(completion(index=i, text=self.texts[k], token_ids=[self.token] * k, cumulative_logprob=-0.5 * k,
                                   logprobs=top, finish_reason="length", score=-0.5 * k - i if beam else None))
        stats = request_stats()
        stats.num_prompt_tokens = len(ids)
        stats.num_generated_tokens = k * len(outs)
        self.prompt_tokens += len(ids)
        self.generated_tokens += k * count
        return request_output(request_id=request.request_id, prompt=None, prompt_token_ids=list(ids), outputs=outs,
                              stats=stats)

    def stats(self) -> dict[str, int]:
        return {"num_prompt_tokens": self.prompt_tokens, "num_generated_tokens": self.generated_tokens}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _per_line_fsync() -> None:
    """Make the run's writer fsync every line instead of the default group commit."""
    import batchgen.run.execute
    from batchgen.io.output_file import JsonlWriter

    class PerLineWriter(JsonlWriter):
        def __init__(self, path: Any, *, group_commit: bool = False) -> None:
            super().__init__(path, group_commit=False)

    batchgen.run.execute.JsonlWriter = PerLineWriter  # type: ignore[misc]


def _batch_job(path: str, out: str) -> Any:
    """The planned job of a batch file on SmolLM2, its output overwritten."""
    from batchgen.config import validate_config
    from batchgen.run.plan import plan

    return plan(validate_config({"model": {"name": "smollm2-135m-instruct"},
                                 "data": {"source": path, "format": "openai_batch"},
                                 "output": {"path": out, "if_exists": "overwrite"}}))


def stream_worker(source: str, output: str, per_line_fsync: bool = False) -> dict[str, Any]:
    """One timed run of a batch file on the instant engine (in this fresh process), its memory
    sampled every 50 ms. ``per_line_fsync`` writes with one fsync per line instead of the
    default group commit.
    """
    if per_line_fsync:
        _per_line_fsync()
    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model
    from batchgen.run.execute import execute

    engine = InstantEngine(AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path))
    # Warm-up, not timed: a small file through the same path loads every lazy import and cache.
    warm = Path(output).with_suffix(".warm.jsonl")
    make_batch_file(warm, 500, seed=1)
    execute(_batch_job(str(warm), str(warm.with_suffix(".out"))), quiet=True, llm=engine)
    engine.answered = 0
    measured = _batch_job(source, output)
    baseline = rss_mib()
    samples: list[tuple[float, int, float]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, engine.answered, rss_mib()))
            stop.wait(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    summary = execute(measured, quiet=True, llm=engine)
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    samples.append((seconds, engine.answered, rss_mib()))
    lines = summary["records"]["total"]
    return {
        "lines": lines, "failed": summary["request_counts"]["failed"], "seconds": seconds,
        "lines_per_s": lines / seconds, "rss_baseline_mib": baseline,
        "rss_peak_sampled_mib": max(s[2] for s in samples), "ru_maxrss_mib": peak_rss_mib(),
        "rss_samples": [[round(t, 3), n, round(r, 2)] for t, n, r in samples],
        "output_bytes": Path(output).stat().st_size,
        "fsync": "per line" if per_line_fsync else "group commit",
    }


# --------------------------------------------------------------------------- W32


def w32_files(folder: Path) -> tuple[Path, Path]:
    """W32 as a batch file of chat lines, and as a dataset of the same templated prompts."""
    from bench.workload import load_w32

    batch, rows = folder / "w32_batch.jsonl", folder / "w32_rows.jsonl"
    with open(batch, "w") as fb, open(rows, "w") as fr:
        for r in load_w32():
            messages = []
            for turn in r["text"].split("<|im_start|>")[1:]:
                role, _, content = turn.partition("\n")
                if role in ("system", "user"):
                    messages.append({"role": role, "content": content.removesuffix("<|im_end|>\n")})
            body = {"messages": messages, "max_tokens": 64, "temperature": 0}
            fb.write(json.dumps({"custom_id": f"w32-{r['index']}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}) + "\n")
            fr.write(json.dumps({"id": f"w32-{r['index']}", "text": r["text"], "ids": r["prompt_token_ids"]}) + "\n")
    return batch, rows


def w32_worker(kind: str, source: str, output: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from batchgen import LLM
    from batchgen.config import validate_config
    from batchgen.run.execute import execute
    from batchgen.run.plan import plan

    engine = {"kv_cache_memory": 256 * 2**20, "max_num_seqs": 256, "max_num_batched_tokens": 2048}
    if kind == "batch":
        raw = {"data": {"source": source, "format": "openai_batch"}}
    else:
        raw = {"data": {"source": source, "id_column": "id"}, "prompt": {"column": "text", "chat_template": False},
               "generation": {"mode": "greedy", "max_tokens": 64}}
    config = validate_config({**raw, "model": {"dtype": "float32"}, "engine": engine,
                              "output": {"path": output, "if_exists": "overwrite"}})
    job = plan(config)
    llm = LLM(dtype="float32", block_size=16, kv_cache_memory=engine["kv_cache_memory"], max_num_seqs=256,
              max_num_batched_tokens=2048)
    llm.generate([[504, 3458, 282, 1345] * 6], __import__("batchgen").SamplingParams(temperature=0, max_tokens=4))
    summary = execute(job, quiet=True, llm=llm)
    speed = summary["throughput"]
    # Prompt ids actually sent, to check both paths ran the same job.
    lines = [json.loads(x) for x in Path(output).read_text().splitlines()]
    if kind == "batch":
        texts = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in lines}
    else:
        texts = {x["id"]: x["generations"][0]["text"] for x in lines}
    return {"kind": kind, "seconds": speed["seconds"], "generated_tokens": speed["generated_tokens"],
            "prompt_tokens": speed["prompt_tokens"], "tokens_per_s": speed["generated_tokens_per_s"],
            "texts": texts, "peak_rss_mib": peak_rss_mib()}


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
