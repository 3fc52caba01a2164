"""The ``scoring`` part: lm-eval's multiple-choice and rolling-perplexity requests, per backend.

Workloads (built here, deterministic, from the chat prompts of W32, ``bench/w32.jsonl``):

* **multiple choice** (``mc_requests``): ``--scoring-questions`` questions (200 in the full
  run) of 4 choices each. Every context is one 5-shot prefix (5 solved questions, about 400
  tokens) plus its own question (about 40 tokens: sentences of W32's user messages); each
  choice is 5 to 20 tokens (a shot's answer 20 to 34) of W32 words after a space. The answer index is random (seeded), so
  accuracy measures agreement between backends, not the model.
* **perplexity** (``ppl_texts``): W32's user messages joined into texts until about
  ``--scoring-ppl-tokens`` tokens (100K in the full run), scored by ``loglikelihood_rolling``
  in windows of ``max_length`` 2048.

Peers, each in its own process (``python -m bench.scoring child ...``) at the same thread count
and dtype, interleaved per repeat; each gets lm-eval ``Instance`` objects and answers them with
its ``loglikelihood`` / ``loglikelihood_rolling`` exactly as lm-eval's evaluator calls them:

* ``batchgen``: :class:`batchgen.integrations.lm_eval.BatchgenLM` (one engine call per request
  type, prefix cache on, 512 MiB of KV);
* ``hf``: lm-eval's ``hf`` model (``HFLM``) on the same fp32 folder, ``batch_size`` 16;
* ``vllm``: lm-eval's ``vllm`` model, when ``import vllm`` works in this venv (it does not
  here: vLLM's CPU build lives in its own venv, see ``bench/peers/vllm_worker.py``).

Reported per peer and dtype: questions/s and scored (continuation) tokens/s of the timed call
(model load and a 2-request warm-up excluded), the prompt tokens computed (batchgen: the
engine's ``num_prefill_tokens``; HF: every context + continuation token but the last, which its
batches compute in full), accuracy and length-normalised accuracy, the largest loglikelihood
difference to ``hf`` of the same dtype, and the process's peak RSS; for perplexity tokens/s,
the word perplexity and the peak RSS (at two text lengths, for the memory's growth).
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
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
SHOTS = 5
CHOICES = 4
HF_BATCH = 16
PPL_MAX_LENGTH = 2048
KV_MEMORY = "512MiB"


# ---------------------------------------------------------------------------- workloads
def _user_texts() -> list[str]:
    texts = []
    for line in (REPO / "bench" / "w32.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        texts.append(user.strip())
    return texts


def _sentences() -> list[str]:
    out = []
    for text in _user_texts():
        for part in text.replace("?", "?|").replace(".", ".|").split("|"):
            if part.strip():
                out.append(part.strip())
    return out


def mc_requests(tokenizer, questions: int, seed: int = 0) -> dict[str, Any]:
    """``{"pairs": [(context, continuation)...], "answers": [...], "choices": 4}``, question by
    question, choice by choice."""
    rng = random.Random(seed)
    sentences = _sentences()
    words = sorted({w.strip(".,?!") for s in sentences for w in s.split() if w.strip(".,?!")})

    def question() -> str:
        parts: list[str] = []
        while len(tokenizer.encode(" ".join(parts))) < 36:
            parts.append(rng.choice(sentences))
        return " ".join(parts)

    def choice(lo: int = 5, hi: int = 20) -> str:
        target = rng.randint(lo, hi)
        picked: list[str] = []
        while len(tokenizer.encode(" " + " ".join(picked))) < target:
            picked.append(rng.choice(words))
        return " " + " ".join(picked)

    shots = "".join(f"Question: {question()}\nAnswer:{choice(20, 34)}\n\n" for _ in range(SHOTS))
    pairs, answers = [], []
    for _ in range(questions):
        context = shots + f"Question: {question()}\nAnswer:"
        pairs.extend((context, choice()) for _ in range(CHOICES))
        answers.append(rng.randrange(CHOICES))
    return {"pairs": pairs, "answers": answers, "choices": CHOICES,
            "prefix_tokens": len(tokenizer.encode(shots))}


def ppl_texts(tokenizer, tokens: int) -> list[str]:
    """Texts of W32 user messages (in a fixed shuffled order), about 10K tokens each, ``tokens`` in all."""
    rng = random.Random(1)
    base = _user_texts()
    texts, current, total = [], [], 0
    while total < tokens:
        current.append(rng.choice(base))
        if len(tokenizer.encode(" ".join(current))) >= min(10_000, tokens - total):
            texts.append(" ".join(current))
            total += len(tokenizer.encode(texts[-1]))
            current = []
    return texts


# ---------------------------------------------------------------------------- one peer (child)
def _make_lm(peer: str, model_path: str, dtype: str, threads: int, max_length: int):
    import torch

    torch.set_num_threads(threads)
    if peer == "batchgen":
        from batchgen.integrations.lm_eval import BatchgenLM

        return BatchgenLM(pretrained=model_path, dtype=dtype, num_threads=threads, max_length=max_length,
                          kv_cache_memory=KV_MEMORY)
    if peer == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=model_path, dtype=dtype, device="cpu", batch_size=HF_BATCH, max_length=max_length)
    if peer == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        return VLLM(pretrained=model_path, dtype=dtype, max_model_len=max_length, enable_prefix_caching=True)
    raise ValueError(f"unknown peer {peer!r}")


def _instances(kind: str, items: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=tuple(args), idx=i) for i, args in enumerate(items)]


def _prefill(lm, peer: str) -> int | None:
    return lm.llm.stats().num_prefill_tokens if peer == "batchgen" else None


def child(args: argparse.Namespace) -> dict:
    work = json.loads(Path(args.workload).read_text())
    lm = _make_lm(args.peer, args.model, args.dtype, args.threads, args.max_length)
    if args.kind == "mc":
        pairs = [tuple(p) for p in work["pairs"]]
        lm.loglikelihood(_instances("loglikelihood", [("Hello there", " friend"), ("Hello there", " world")]),
                         disable_tqdm=True)
        if args.peer == "batchgen":
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
        scored = sum(len(x) for _, x in (lm._encode_pair(c, x) for c, x in pairs))
        out = {"seconds": seconds, "loglikelihoods": [r[0] for r in results], "prefill_tokens": computed,
               "scored_tokens": scored}
    else:
        texts = work["texts"]
        lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [("A short warm-up text.",)]), disable_tqdm=True)
        t0 = time.perf_counter()
        results = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]),
                                           disable_tqdm=True)
        seconds = time.perf_counter() - t0
        tokens = sum(len(lm.tok_encode(t)) for t in texts)
        words = sum(len(t.split()) for t in texts)
        out = {"seconds": seconds, "loglikelihoods": list(results), "tokens": tokens, "words": words}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# ---------------------------------------------------------------------------- the part (parent)
def _run_child(peer: str, kind: str, workload: Path, dtype: str, threads: int, model: str, max_length: int,
               timeout: float, log: Callable[[str], None]) -> dict:
    cmd = [sys.executable, "-m", "bench.scoring", "child", "--peer", peer, "--kind", kind, "--workload",
           str(workload), "--dtype", dtype, "--threads", str(threads), "--model", model,
           "--max-length", str(max_length)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
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


def _mc_fields(res: dict, work: dict, pairs_tokens: list[int]) -> dict:
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
            "scored_tokens_per_s": res["scored_tokens"] / res["seconds"], "prefill_tokens": res["prefill_tokens"],
            "scored_tokens": res["scored_tokens"], "acc": acc / n, "acc_norm": acc_norm / n,
            "peak_rss_mib": res["peak_rss_mib"]}


def run_part(args, out: Path, log: Callable[[str], None], machine: Callable[[], dict],
             save: Callable[[str, dict, Path], None], vllm_importable: bool) -> dict:
    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model

    model = resolve_model("smollm2-135m-instruct").path
    tokenizer = AutoTokenizer.from_pretrained(model)
    threads = args.threads_given or 2
    peers = ["batchgen", "hf"] + (["vllm"] if vllm_importable else [])
    if args.peers:
        peers = [p for p in peers if p in args.peers]
    work = mc_requests(tokenizer, args.scoring_questions)
    ppl_sizes = [args.scoring_ppl_tokens // 4, args.scoring_ppl_tokens]
    texts = {size: ppl_texts(tokenizer, size) for size in ppl_sizes}
    tmp = Path("/tmp/bench-scoring")
    tmp.mkdir(exist_ok=True)
    (tmp / "mc.json").write_text(json.dumps(work))
    for size, t in texts.items():
        (tmp / f"ppl{size}.json").write_text(json.dumps({"texts": t}))
    unique = len(tokenizer.encode(work["pairs"][0][0])) + sum(
        len(tokenizer.encode(c + x)) - len(tokenizer.encode(work["pairs"][0][0]))
        for c, x in work["pairs"])  # a rough bound: prefix once plus everything after it per choice
    result: dict[str, Any] = {
        "machine": machine(), "threads": threads, "peers": peers,
        "vllm": "lm-eval's vllm model ran" if vllm_importable else
                "not run: vllm is not importable in batchgen's venv (its CPU build lives in /tmp/vllm-venv, absent here)",
        "workload": {"questions": len(work["answers"]), "choices": CHOICES, "prefix_tokens": work["prefix_tokens"],
                     "pairs": len(work["pairs"]), "ppl_tokens": ppl_sizes, "ppl_max_length": PPL_MAX_LENGTH,
                     "unique_tokens_bound": unique},
        "mc": {}, "ppl": {},
    }
    for dtype in args.scoring_dtypes:
        runs: dict[str, list[dict]] = {p: [] for p in peers}
        for rep in range(args.repeats):
            order = peers if rep % 2 == 0 else list(reversed(peers))
            for peer in order:
                res = _run_child(peer, "mc", tmp / "mc.json", dtype, threads, model, 8192, args.run_timeout, log)
                runs[peer].append(res)
        rows = {}
        ref = next((r for r in runs.get("hf", []) if "error" not in r), None)
        for peer, reps in runs.items():
            ok = [r for r in reps if "error" not in r]
            if not ok:
                rows[peer] = {"error": reps[-1]["error"]}
                continue
            fields = [_mc_fields(r, work, []) for r in ok]
            best = min(fields, key=lambda f: f["seconds"])
            best["questions_per_s_all"] = [f["questions_per_s"] for f in fields]
            if ref is not None:
                best["max_abs_diff_vs_hf"] = max(abs(a - b) for a, b in zip(ok[0]["loglikelihoods"], ref["loglikelihoods"]))
            rows[peer] = best
        for peer, row in rows.items():
            if peer != "hf" and "error" not in row and "error" not in rows.get("hf", {"error": 1}):
                qps = [a / b for a, b in zip(row["questions_per_s_all"], rows["hf"]["questions_per_s_all"])]
                row["speedup_vs_hf"] = statistics.median(qps)
                row["speedup_vs_hf_range"] = [min(qps), max(qps)]
        result["mc"][dtype] = rows
        ppl_rows: dict[str, dict] = {}
        for size in ppl_sizes:
            for peer in peers:
                res = _run_child(peer, "ppl", tmp / f"ppl{size}.json", dtype, threads, model, PPL_MAX_LENGTH,
                                 args.run_timeout, log)
                if "error" in res:
                    ppl_rows[f"{peer}@{size}"] = res
                    continue
                total = sum(res["loglikelihoods"])
                import math
                ppl_rows[f"{peer}@{size}"] = {
                    "tokens": res["tokens"], "seconds": res["seconds"], "tokens_per_s": res["tokens"] / res["seconds"],
                    "word_perplexity": math.exp(-total / res["words"]), "peak_rss_mib": res["peak_rss_mib"]}
        result["ppl"][dtype] = ppl_rows
        save("scoring", result, out)
    plot(result, out)
    return result


def plot(result: dict, out: Path) -> None:
    """``scoring.png``: questions/s per peer and dtype, and perplexity peak RSS per text length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    dtypes = list(result["mc"])
    peers = result["peers"]
    width = 0.8 / max(1, len(peers))
    for i, peer in enumerate(peers):
        vals = [result["mc"][d].get(peer, {}).get("questions_per_s", 0) for d in dtypes]
        ax1.bar([x + i * width for x in range(len(dtypes))], vals, width, label=peer)
    ax1.set_xticks([x + width * (len(peers) - 1) / 2 for x in range(len(dtypes))], dtypes)
    ax1.set_ylabel("questions/s")
    ax1.set_title(f"{result['workload']['questions']} questions x 4 choices, 5-shot prefix")
    ax1.legend()
    for peer in peers:
        for d in dtypes:
            pts = sorted((v["tokens"], v["peak_rss_mib"]) for k, v in result["ppl"].get(d, {}).items()
                         if k.startswith(peer + "@") and "error" not in v)
            if pts:
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{peer} {d}")
    ax2.set_xlabel("tokens scored (rolling)")
    ax2.set_ylabel("peak RSS (MiB)")
    ax2.set_title("rolling perplexity: peak RSS")
    ax2.legend()
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
