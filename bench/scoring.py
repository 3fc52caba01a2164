"""The ``scoring`` part: lm-eval's multiple-choice and rolling-perplexity requests, per backend.

Workloads (``bench/scoring_workload.py``, deterministic, from W32's chat prompts, ``bench/w32.jsonl``):

* **multiple choice** (``mc_requests``): ``--scoring-questions`` questions (200 in the full
  run) of 4 choices each. Every context is one 5-shot prefix (5 solved questions, about 400
  tokens) plus its own question (about 40 tokens: sentences of W32's user messages); each
  choice is 5 to 20 tokens (a shot's answer 20 to 34) of W32 words after a space. The answer
  index is random (seeded), so accuracy measures agreement between backends, not the model.
* **perplexity** (``ppl_texts``): W32's user messages joined into texts of about 10K tokens,
  ``--scoring-ppl-tokens`` in all (50K in the full run; also a quarter of it, or the sizes of
  ``--scoring-ppl-sizes``), scored by ``loglikelihood_rolling`` in windows of ``max_length`` 2048.

``--scoring-kinds`` picks ``mc``, ``ppl`` or both. Each peer runs in its own process at the
same thread count and dtype, ``--repeats`` times interleaved (order reversed every other repeat;
a ratio pairs one repeat's runs). batchgen and ``hf`` answer lm-eval ``Instance`` objects with
``loglikelihood`` / ``loglikelihood_rolling`` as lm-eval's evaluator calls them (``python -m
bench.scoring child ...``): ``batchgen`` (:class:`~batchgen.integrations.lm_eval.BatchgenLM` on
the fp32 or bf16 folder, prefix cache on, 512 MiB of KV), ``batchgen_gguf`` (float32 only: the
same on SmolLM2's Q4_1 file, ``quantization gguf``), ``hf`` (lm-eval's ``HFLM``, ``batch_size``
16: the reference). ``vllm``: vLLM's CPU build in its own venv (``bench/peers/vllm_scoring.py``,
``--no-vllm`` leaves it out), given lm-eval ``vllm``'s inputs (``bench/scoring_vllm.py``),
scored as that model does in one ``generate`` (``batch_size auto``), block 32, prefix caching on.

Reported per peer and dtype: questions/s and scored (continuation) tokens/s of the timed call
(model load and a warm-up excluded), the prompt tokens computed (batchgen: the engine's
``num_prefill_tokens``; HF: every context + continuation token but the last, which its
batches compute in full; vLLM: input tokens not found in its prefix cache), accuracy and
length-normalised accuracy, the largest loglikelihood difference to ``hf`` of the same dtype,
and the process's peak RSS; for perplexity tokens/s, the word perplexity and the peak RSS;
``speedup_vs_hf`` / ``speedup_vs_vllm``: the median (and range) of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import scoring_vllm
from bench.scoring_workload import CHOICES, mc_requests, ppl_texts

REPO = Path(__file__).resolve().parent.parent
HF_BATCH = 16
PPL_MAX_LENGTH = 2048
MC_MAX_LENGTH = 8192
KV_MEMORY = "512MiB"
GGUF_MODEL = "smollm2-135m-instruct"  # the built-in alias; with quantization gguf, its Q4_1 file


# ---------------------------------------------------------------------------- one peer (child)
def _make_lm(peer: str, model_path: str, dtype: str, threads: int, max_length: int):
    import torch

    torch.set_num_threads(threads)
    if peer in ("batchgen", "batchgen_gguf"):
        from batchgen.integrations.lm_eval import BatchgenLM

        extra = {"quantization": "gguf"} if peer == "batchgen_gguf" else {}
        return BatchgenLM(pretrained=GGUF_MODEL if extra else model_path, dtype=dtype, num_threads=threads,
                          max_length=max_length, kv_cache_memory=KV_MEMORY, **extra)
    if peer == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=model_path, dtype=dtype, device="cpu", batch_size=HF_BATCH, max_length=max_length)
    raise ValueError(f"unknown peer {peer!r}")


def _instances(kind: str, items: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=tuple(args), idx=i) for i, args in enumerate(items)]


def _prefill(lm, peer: str) -> int | None:
    return lm.llm.stats().num_prefill_tokens if peer.startswith("batchgen") else None


def _child_mc(lm, args: argparse.Namespace, work: dict) -> dict:
    pairs = [tuple(p) for p in work["pairs"]]
    lm.loglikelihood(_instances("loglikelihood", [("Hello there", " friend"), ("Hello there", " world")]),
                     disable_tqdm=True)
    if args.peer.startswith("batchgen"):
        lm.llm.reset_prefix_cache()
    before = _prefill(lm, args.peer)
    t0 = time.perf_counter()
    results = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    seconds = time.perf_counter() - t0
    after = _prefill(lm, args.peer)
    if args.peer == "hf":
        enc = [lm._encode_pair(c, x) for c, x in pairs]
        computed = sum(min(len(c) + len(x) - 1, args.max_length) for c, x in enc)
    else:
        computed = after - before if after is not None else None
    return {"seconds": seconds, "loglikelihoods": [r[0] for r in results], "prefill_tokens": computed}


def _child_ppl(lm, work: dict) -> dict:
    texts = work["texts"]
    lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [("A short warm-up text.",)]), disable_tqdm=True)
    t0 = time.perf_counter()
    results = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]),
                                       disable_tqdm=True)
    return {"seconds": time.perf_counter() - t0, "loglikelihoods": list(results)}


def child(args: argparse.Namespace) -> dict:
    work = json.loads(Path(args.workload).read_text())
    lm = _make_lm(args.peer, args.model, args.dtype, args.threads, args.max_length)
    out = _child_mc(lm, args, work) if args.kind == "mc" else _child_ppl(lm, work)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# ---------------------------------------------------------------------------- the part (parent)
def _run_child(peer: str, kind: str, workload: Path, dtype: str, threads: int, model: str, max_length: int,
               timeout: float, log: Callable[[str], None]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if peer == "vllm":
        cmd = scoring_vllm.command(model, scoring_vllm.inputs_path(workload, max_length), dtype, max_length, env,
                                   threads)
    else:
        cmd = [sys.executable, "-m", "bench.scoring", "child", "--peer", peer, "--kind", kind, "--workload",
               str(workload), "--dtype", dtype, "--threads", str(threads), "--model", model,
               "--max-length", str(max_length)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][-400:]}
    result = json.loads(lines[-1][len("@@RESULT "):])
    log(f"  {peer} {kind} {dtype}: {result['seconds']:.1f} s timed ({time.time() - t0:.0f} s with load)")
    return result


def _mc_fields(res: dict, work: dict) -> dict:
    lls = res["loglikelihoods"]
    n = len(work["answers"])
    acc = acc_norm = 0
    for q in range(n):
        block = lls[q * CHOICES:(q + 1) * CHOICES]
        conts = work["pairs"][q * CHOICES:(q + 1) * CHOICES]
        norm = [lp / len(c.encode()) for lp, (_, c) in zip(block, conts)]
        acc += max(range(CHOICES), key=block.__getitem__) == work["answers"][q]
        acc_norm += max(range(CHOICES), key=norm.__getitem__) == work["answers"][q]
    return {"seconds": res["seconds"], "questions_per_s": n / res["seconds"],
            "scored_tokens_per_s": work["scored_tokens"] / res["seconds"], "prefill_tokens": res["prefill_tokens"],
            "scored_tokens": work["scored_tokens"], "acc": acc / n, "acc_norm": acc_norm / n,
            "peak_rss_mib": res["peak_rss_mib"]}


def _ppl_fields(res: dict, work: dict) -> dict:
    total = sum(res["loglikelihoods"])
    return {"tokens": work["tokens"], "seconds": res["seconds"], "tokens_per_s": work["tokens"] / res["seconds"],
            "word_perplexity": math.exp(-total / work["words"]), "peak_rss_mib": res["peak_rss_mib"]}


def _rows(runs: dict[str, list[dict]], fields: Callable[[dict], dict], rate: str, compare: list[str]) -> dict:
    """Per peer: its fastest repeat's fields, every repeat's ``rate``, and against each peer of
    ``compare`` the median (and range) of the per-repeat ratios of ``rate`` (repeats ran
    interleaved, so each ratio pairs runs that saw the same machine load)."""
    rows: dict[str, dict] = {}
    for peer, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        if not ok:
            rows[peer] = {"error": reps[-1]["error"] if reps else "not run"}
            continue
        all_fields = [fields(r) for r in ok]
        best = min(all_fields, key=lambda f: f["seconds"])
        best[rate + "_all"] = [f[rate] for f in all_fields]
        best["loglikelihoods_first"] = ok[0]["loglikelihoods"]
        rows[peer] = best
    for peer, row in rows.items():
        for ref in compare:
            if peer == ref or "error" in row or "error" in rows.get(ref, {"error": 1}):
                continue
            ratios = [a / b for a, b in zip(row[rate + "_all"], rows[ref][rate + "_all"])]
            row[f"speedup_vs_{ref}"] = statistics.median(ratios)
            row[f"speedup_vs_{ref}_range"] = [min(ratios), max(ratios)]
    ref = rows.get("hf", {}).get("loglikelihoods_first")
    for row in rows.values():  # the largest per-request difference to hf's numbers, then drop them
        mine = row.pop("loglikelihoods_first", None)
        if ref is not None and mine is not None:
            row["max_abs_diff_vs_hf"] = max(abs(a - b) for a, b in zip(mine, ref))
    return rows


def _interleaved(peers: list[str], repeats: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """Every peer ``repeats`` times, the order reversed every other repeat."""
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for rep in range(repeats):
        for peer in (peers if rep % 2 == 0 else list(reversed(peers))):
            runs[peer].append(run(peer))
    return runs


def _prepare(tokenizer, args, tmp: Path) -> tuple[dict, dict[int, dict]]:
    """Write the workloads (and vLLM's token inputs) under ``tmp``; return the MC workload and
    the perplexity workloads by size, each with its token and word counts."""
    from batchgen.engine.loglikelihood import encode, encode_pair

    work = mc_requests(tokenizer, args.scoring_questions)
    work["scored_tokens"] = sum(len(encode_pair(tokenizer, c, x)[1]) for c, x in work["pairs"])
    (tmp / "mc.json").write_text(json.dumps(work))
    scoring_vllm.write_inputs(tokenizer, "mc", work, tmp / "mc.json", MC_MAX_LENGTH)
    ppl: dict[int, dict] = {}
    for size in args.scoring_ppl_sizes:
        texts = ppl_texts(tokenizer, size)
        ppl[size] = {"texts": texts, "tokens": sum(len(encode(tokenizer, t)) for t in texts),
                     "words": sum(len(t.split()) for t in texts)}
        (tmp / f"ppl{size}.json").write_text(json.dumps(ppl[size]))
        scoring_vllm.write_inputs(tokenizer, "ppl", ppl[size], tmp / f"ppl{size}.json", PPL_MAX_LENGTH)
    return work, ppl


def _peers(args, dtype: str, vllm_ok: bool) -> list[str]:
    peers = ["batchgen"] + (["batchgen_gguf"] if dtype == "float32" else []) + ["hf"] + (["vllm"] if vllm_ok else [])
    return [p for p in peers if p in args.peers] if args.peers else peers


def run_part(args, out: Path, log: Callable[[str], None], machine: Callable[[], dict],
             save: Callable[[str, dict, Path], None], vllm: tuple[bool, str]) -> dict:
    """The part: every dtype of ``--scoring-dtypes``, MC then each perplexity size, the peers
    interleaved over ``--repeats`` repeats; saves ``scoring.json`` after each dtype."""
    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model

    model = resolve_model("smollm2-135m-instruct").path
    tokenizer = AutoTokenizer.from_pretrained(model)
    threads = args.threads_given or 2
    tmp = Path("/tmp/bench-scoring")
    tmp.mkdir(exist_ok=True)
    work, ppl = _prepare(tokenizer, args, tmp)
    result: dict[str, Any] = {
        "machine": machine(), "threads": threads, "repeats": args.repeats, "kinds": args.scoring_kinds,
        "vllm": f"{vllm[1]}; CPU build, block size {scoring_vllm.BLOCK_SIZE}, lm-eval vllm's requests (bench/peers/vllm_scoring.py)"
                if vllm[0] else f"not run: {vllm[1]}",
        "gguf_file": resolve_model(GGUF_MODEL, quantization="gguf").gguf_file,
        "workload": {"questions": len(work["answers"]), "choices": CHOICES, "prefix_tokens": work["prefix_tokens"],
                     "pairs": len(work["pairs"]), "scored_tokens": work["scored_tokens"],
                     "ppl_tokens": {size: w["tokens"] for size, w in ppl.items()}, "ppl_max_length": PPL_MAX_LENGTH},
        "mc": {}, "ppl": {},
    }
    if args.merge and (out / "scoring.json").exists():  # another kind or dtype added to an earlier run's
        earlier = json.loads((out / "scoring.json").read_text())
        result = {**earlier, "runs": earlier.get("runs", [{k: earlier.get(k) for k in ("machine", "kinds", "repeats")}])
                  + [{k: result[k] for k in ("machine", "kinds", "repeats")}], "mc": earlier["mc"], "ppl": earlier["ppl"]}
    for dtype in args.scoring_dtypes:
        peers = _peers(args, dtype, vllm[0])
        result["peers_" + dtype] = peers
        compare = [p for p in ("hf", "vllm") if p in peers]
        if "mc" in args.scoring_kinds:
            runs = _interleaved(peers, args.repeats, lambda p: _run_child(
                p, "mc", tmp / "mc.json", dtype, threads, model, MC_MAX_LENGTH, args.run_timeout, log))
            result["mc"][dtype] = _rows(runs, lambda r: _mc_fields(r, work), "questions_per_s", compare)
            save("scoring", result, out)
        for size, w in (ppl.items() if "ppl" in args.scoring_kinds else ()):
            path = tmp / f"ppl{size}.json"

            def one(p: str) -> dict:
                res = _run_child(p, "ppl", path, dtype, threads, model, PPL_MAX_LENGTH, args.run_timeout, log)
                return scoring_vllm.sum_windows(res, scoring_vllm.inputs_path(path, PPL_MAX_LENGTH)) if p == "vllm" else res
            runs = _interleaved(peers, args.repeats, one)
            result["ppl"].setdefault(dtype, {})[str(size)] = _rows(runs, lambda r: _ppl_fields(r, w), "tokens_per_s",
                                                                   compare)
            save("scoring", result, out)
    plot(result, out)
    return result


def plot(result: dict, out: Path) -> None:
    """``scoring.png``: MC questions/s per peer and dtype, and rolling-perplexity tokens/s per
    peer and dtype against the text length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    dtypes = list(result["mc"])
    peers = sorted({p for d in dtypes for p in result["mc"][d]}, key=lambda p: (p != "batchgen", p))
    width = 0.8 / max(1, len(peers))
    for i, peer in enumerate(peers):
        vals = [result["mc"][d].get(peer, {}).get("questions_per_s", 0) for d in dtypes]
        ax1.bar([x + i * width for x in range(len(dtypes))], vals, width, label=peer)
    ax1.set_xticks([x + width * (len(peers) - 1) / 2 for x in range(len(dtypes))], dtypes)
    ax1.set_ylabel("questions/s")
    ax1.set_title(f"MC: {result['workload']['questions']} questions x 4 choices, 5-shot prefix")
    if dtypes:
        ax1.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax1.transAxes)
    for dtype, sizes in result["ppl"].items():
        for peer in sorted({p for rows in sizes.values() for p in rows}):
            pts = sorted((v["tokens"], v["tokens_per_s"]) for rows in sizes.values()
                         for p, v in rows.items() if p == peer and "error" not in v)
            if pts:
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{peer} {dtype}")
    ax2.set_xscale("log")
    sizes_run = sorted({v["tokens"] for d in result["ppl"].values() for rows in d.values() for v in rows.values()
                        if "tokens" in v})
    ax2.set_xticks(sizes_run, [f"{n:,}" for n in sizes_run], minor=False)
    ax2.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax2.set_xlabel("tokens scored (rolling, windows of 2048)")
    ax2.set_ylabel("tokens/s (fastest repeat)")
    ax2.set_title("rolling perplexity")
    ax2.legend(fontsize=8)
    load = result["machine"].get("loadavg_at_start") or [float("nan")]
    fig.suptitle(f"SmolLM2-135M, {result['threads']} threads; machine shared with other jobs "
                 f"(1-min load {load[0]:.1f} on {result['machine'].get('cpu_count')} CPUs at the start)", fontsize=9)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "scoring.png", dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scoring")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("child")
    c.add_argument("--peer", required=True)
    c.add_argument("--kind", choices=["mc", "ppl"], required=True)
    c.add_argument("--workload", required=True)
    c.add_argument("--dtype", default="float32")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--model", required=True)
    c.add_argument("--max-length", type=int, default=8192)
    args = ap.parse_args(argv)
    result = child(args)
    print("@@RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
