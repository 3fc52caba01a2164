"""The worker side of ``bench.openai_batch`` (each run in a fresh process the driver spawns):
the batch file workload, the *instant engine* (the real SmolLM2 tokenizer and chat template, no
model: it answers each request at once with a fixed completion), the stream worker (one timed run
of a batch file through ``plan`` + ``execute``, its memory sampled every 50 ms) and the W32
workers (W32 as a batch file of chat lines, and as a dataset through ``batchgen run``). See
``bench/openai_batch.py`` for what is measured.
"""

from __future__ import annotations

import json
import os
import random
import resource
import threading
import time
from itertools import islice
from pathlib import Path
from typing import Any

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
