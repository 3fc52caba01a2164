"""Worker processes and the interleaved repeat loop.

Every peer runs in its own process (``bench.worker``, or the vLLM venv's interpreter running
``bench/peers/vllm_worker.py``). For one mode, all peers are started (loading is not timed),
then the repeats run round-robin: repeat r runs every peer once, in an order rotated by r, so
that the load other processes put on the machine falls on all peers alike. Ratios are taken
within the run, per repeat and from the medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("BENCH_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
LLAMA_PYTHON = Path(os.environ.get("BENCH_LLAMA_PYTHON", "/tmp/llama-venv/bin/python"))


def llama_cpp_python() -> str:
    """The interpreter that runs the llama.cpp peer: ``BENCH_LLAMA_PYTHON`` when set, else this
    one if it imports ``llama_cpp`` (the ``gguf-oracle`` extra), else ``/tmp/llama-venv``'s."""
    import importlib.util

    if "BENCH_LLAMA_PYTHON" not in os.environ and importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return str(LLAMA_PYTHON)


class WorkerError(RuntimeError):
    """A worker died, timed out or answered something unreadable; the message says which."""


@dataclass
class Worker:
    """A running peer process. ``setup`` is its ``@@READY`` record."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    setup: dict = field(default_factory=dict)
    _lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._lines.append("@@EOF")
            self._cond.notify_all()

    def _next(self, timeout: float) -> tuple[str, dict]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._lines:
                    line = self._lines.pop(0)
                    if line.startswith("@@EOF"):
                        raise WorkerError(f"{self.name}: worker exited (code {self.proc.poll()}); "
                                          f"see {self.log_path}: {tail(self.log_path)}")
                    if line.startswith("@@"):
                        tag, _, payload = line.partition(" ")
                        return tag, json.loads(payload)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s (killed)")
                self._cond.wait(left)

    def wait_ready(self, timeout: float) -> dict:
        tag, payload = self._next(timeout)
        if tag != "@@READY":
            raise WorkerError(f"{self.name}: expected @@READY, got {tag} {payload}")
        self.setup = payload
        return payload

    def run(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int, timeout: float) -> dict:
        """One timed generate in the worker. Returns its result, or ``{"unsupported"}`` /
        ``{"error"}`` records; raises WorkerError if the worker dies or times out."""
        assert self.proc.stdin is not None
        cmd = {"prompts": prompts, "mode": mode, "max_tokens": max_tokens, "seed": seed}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        tag, payload = self._next(timeout)
        return payload

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def tail(path: Path, n: int = 600) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:].replace("\n", " | ")


def start_worker(peer: str, options: dict, log_dir: Path, threads: int) -> Worker:
    """Start peer ``peer`` (``batchgen``, ``hf_generate``, ``hf_generate_batch``, ``vllm`` or
    ``llama_cpp``).

    ``options["as"]`` runs another configuration of a peer under its own name (for example
    ``batchgen_nocache`` as ``batchgen`` with ``enable_prefix_caching: false``).
    ``options["threads"]`` overrides ``threads`` for this peer. A thread count of 0 runs the
    peer at its defaults: no ``OMP_NUM_THREADS`` in its environment, torch's thread count
    untouched (batchgen then takes ``num_threads: auto``, the CPUs the process may use).
    ``options["dtype"]`` is the weights' and KV cache's dtype (``float32``, ``bfloat16``);
    for vLLM also ``block_size`` (None: its default, 128 on CPU) and ``kv_gib``; for llama.cpp
    ``gguf`` (the file), ``n_ctx``, ``n_seq_max`` and ``kv_unified``
    (``bench/peers/llama_cpp_worker.py``).
    """
    options = dict(options)
    name, peer = peer, options.pop("as", peer)
    threads = int(options.pop("threads", threads))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{int(time.time() * 1000)}.log"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if peer == "vllm":
        from batchgen.model_resolver import resolve_model

        cores = threads or len(os.sched_getaffinity(0))
        env.update(VLLM_CPU_KVCACHE_SPACE=str(options.pop("kv_gib", 1)),
                   VLLM_CPU_OMP_THREADS_BIND=options.pop("bind", "0" if cores == 1 else f"0-{cores - 1}"),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        cmd = [str(VLLM_PYTHON), str(REPO / "bench" / "peers" / "vllm_worker.py"),
               resolve_model("smollm2-135m-instruct").path, json.dumps(options)]
    elif peer == "llama_cpp":
        gguf = options.pop("gguf")
        cmd = [llama_cpp_python(), str(REPO / "bench" / "peers" / "llama_cpp_worker.py"), gguf,
               json.dumps({**options, "threads": threads})]
    else:
        cmd = [sys.executable, "-m", "bench.worker", peer, json.dumps({**options, "threads": threads})]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True, bufsize=1)
    worker = Worker(name, proc, log_path)
    threading.Thread(target=worker._pump, daemon=True).start()
    return worker


def summarize(runs: list[dict]) -> dict:
    """Medians (and spread) over the successful runs of one peer in one mode."""
    ok = [r for r in runs if "seconds" in r]
    if not ok:
        return {"ok": False, "runs": len(runs)}
    tps = [r["tokens"] / r["seconds"] for r in ok]
    return {"ok": True, "runs": len(ok), "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps), "tokens_per_s_all": tps,
            "seconds_median": statistics.median(r["seconds"] for r in ok),
            "tokens_median": statistics.median(r["tokens"] for r in ok)}


def interleaved(peers: dict[str, dict], prompts: list[list[int]], mode: dict, max_tokens: int,
                repeats: int, log_dir: Path, threads: int, run_timeout: float,
                load_timeout: float = 900, seed: int = 0, on_event=None) -> dict:
    """Start every peer, run ``repeats`` rounds (rotated order), close them.

    Returns ``{peer: {"setup", "runs": [...], "summary", "peak_rss_mib", "status"}}``; a peer
    that fails to start, times out, or does not support the mode is recorded with its reason
    and left out of later rounds.
    """
    say = on_event or (lambda msg: None)
    out: dict[str, dict] = {p: {"runs": [], "status": "ok"} for p in peers}
    workers: dict[str, Worker] = {}
    for name, opts in peers.items():
        workers[name] = start_worker(name, opts, log_dir, threads)
    for name, w in list(workers.items()):
        try:
            out[name]["setup"] = w.wait_ready(load_timeout)
        except WorkerError as exc:
            out[name]["status"] = f"failed to start: {exc}"
            say(out[name]["status"])
            w.kill()
            del workers[name]
    names = list(workers)
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)] if names else []
        for name in order:
            if name not in workers:
                continue
            w = workers[name]
            try:
                res = w.run(prompts, mode, max_tokens, seed + r, run_timeout)
            except WorkerError as exc:
                out[name]["status"] = f"run {r}: {exc}"
                say(out[name]["status"])
                del workers[name]
                continue
            if "unsupported" in res:
                out[name]["status"] = "unsupported: " + res["unsupported"]
                say(f"{name}: {out[name]['status']}")
                workers.pop(name).close()
                continue
            if "error" in res:
                out[name]["status"] = f"run {r} failed: {res['error']}"
                out[name]["traceback"] = res.get("traceback")
                say(f"{name}: {out[name]['status']}")
                workers.pop(name).close()
                continue
            res["repeat"] = r
            out[name]["runs"].append(res)
            say(f"  {name} rep {r}: {res['tokens']} tokens in {res['seconds']:.1f} s "
                f"= {res['tokens'] / res['seconds']:.1f} tok/s, peak RSS {res.get('peak_rss_mib', 0):.0f} MiB")
    for w in workers.values():
        w.close()
    for name, rec in out.items():
        rec["summary"] = summarize(rec["runs"])
        if rec["runs"]:
            rec["peak_rss_mib"] = max(r.get("peak_rss_mib", 0) or 0 for r in rec["runs"])
            rec["kv_bytes"] = rec["runs"][-1].get("kv_bytes")
    return out


def ratios(results: dict, ours: str = "batchgen") -> dict:
    """batchgen's throughput over each peer's: from the medians, and the median of the
    per-repeat ratios (both taken within this run)."""
    base = results.get(ours, {})
    if not base.get("summary", {}).get("ok"):
        return {}
    mine = {r["repeat"]: r["tokens"] / r["seconds"] for r in base["runs"]}
    out = {}
    for name, rec in results.items():
        if name == ours or not rec.get("summary", {}).get("ok"):
            continue
        theirs = {r["repeat"]: r["tokens"] / r["seconds"] for r in rec["runs"]}
        paired = [mine[k] / theirs[k] for k in mine if k in theirs]
        out[name] = {"of_medians": base["summary"]["tokens_per_s_median"] / rec["summary"]["tokens_per_s_median"],
                     "paired_median": statistics.median(paired) if paired else None,
                     "paired_all": paired}
    return out


def select_peers(peers: dict[str, dict], names: list[str]) -> dict[str, dict]:
    """The peers ``names`` asks for (all when empty): by name, or by the name before a
    ``_bs<B>`` block-size suffix (``vllm`` takes every ``vllm_bs<B>``)."""
    if not names:
        return peers
    return {k: v for k, v in peers.items() if k in names or k.split("_bs")[0] in names}


def fmt_cell(peers: dict, name: str | None) -> str:
    """A table cell for peer ``name`` of a result: its tokens/s (:func:`fmt_summary`), why it
    has none, or ``not run``."""
    if not name or name not in peers:
        return "not run"
    s = peers[name].get("summary", {})
    return fmt_summary(s) if s.get("ok") else peers[name].get("status", "failed")[:60]


def fmt_summary(summary: dict) -> str:
    """A peer's tokens/s as ``median (min-max)``."""
    return (f"{summary['tokens_per_s_median']:.1f} ({summary['tokens_per_s_min']:.1f}-"
            f"{summary['tokens_per_s_max']:.1f})")


def fmt_ratio(r: dict | None) -> str:
    """A :func:`ratios` entry as ``of medians× (min-max of the per-repeat ratios)``; – when absent."""
    if not r:
        return "–"
    paired = r.get("paired_all") or []
    spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 else ""
    return f"{r['of_medians']:.2f}×{spread}"
