"""The ``prefix`` part: a few-shot eval whose rows share one long prefix, arriving together.

Workload (``few_shot_prompts``): 256 rows of a few-shot arithmetic eval. Every row is the same
instruction and solved examples (about 600 tokens) followed by its own question (about 15
tokens), tokenised whole with the model's tokenizer; greedy, max_tokens 16. Peers, interleaved
per repeat (``bench.runner``), each in its own process at the same thread count:

* ``batchgen``: the defaults (prefix caching on, ``scheduling_policy="prefix"``), 1 GiB of KV;
* ``batchgen_nocache``: the same with ``enable_prefix_caching=False``;
* ``vllm``: vLLM's CPU build with its prefix caching on (its default), 1 GiB of KV;
* ``hf_generate``: HF ``generate``, static left-padded batches of 32 rows (the whole workload
  in one batch would need about 9 GiB of dense cache).

Reported: end-to-end rows/s of the ``generate`` call (model load and warm-up excluded) and the
prompt tokens each peer computed (batchgen: ``num_prefill_tokens``; vLLM: prompt tokens minus
its ``num_cached_tokens``; HF: the padded batch width times the rows).

Besides, ``simulate`` replays the scheduler alone (``Scheduler`` and ``BlockManager``, no
model; every row generates max_tokens) on rows with 1 to 64 different few-shot prefixes,
interleaved, to count the prompt tokens computed under ``fcfs`` and ``prefix`` scheduling. The
counts are the engine's own (computation is decided by the scheduler alone).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

MIB = 2**20
GIB = 2**30
ROWS = 256
MAX_TOKENS = 16
NUM_SHOTS = 25
HF_BATCH = 32
SIM_PREFIXES = (1, 4, 16, 64)
SIM_KV_BLOCKS = {"512 MiB": 728, "1 GiB": 1456}  # SmolLM2 fp32, blocks of 16 tokens
PEER_LABELS = {"batchgen": "batchgen (prefix cache on)", "batchgen_nocache": "batchgen (prefix cache off)",
               "vllm": "vLLM CPU (prefix cache on)", "hf_generate": "HF generate (static batches of 32)"}


def _shots(rng: random.Random, count: int) -> str:
    lines = ["Answer each question with a number only.\n"]
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        lines.append(f"Q: What is {a} + {b}?\nA: {a + b}\n")
    return "".join(lines)


def few_shot_prompts(tokenizer, rows: int = ROWS, num_prefixes: int = 1, seed: int = 0) -> list[list[int]]:
    """``rows`` prompts: row ``i`` is few-shot prefix ``i % num_prefixes`` (instruction plus
    NUM_SHOTS solved sums) and its own question, tokenised whole."""
    rng = random.Random(seed)
    prefixes = [_shots(rng, NUM_SHOTS) for _ in range(num_prefixes)]
    prompts = []
    for i in range(rows):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        text = prefixes[i % num_prefixes] + f"Q: What is {a} + {b}?\nA:"
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def common_prefix(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt."""
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


# ---------------------------------------------------------------------- scheduler simulation
def simulate(prompts: list[list[int]], policy: str, num_blocks: int, max_tokens: int = MAX_TOKENS,
             block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict:
    """Run the engine's scheduling without a model, as ``LLM.stream`` feeds it (a lookahead
    window of waiting requests); every row generates ``max_tokens`` tokens. Returns the prompt
    tokens computed, the steps and the evictions."""
    from batchgen.engine.block_manager import BlockManager
    from batchgen.engine.scheduler import Scheduler
    from batchgen.engine.sequence import Sequence, SequenceGroup
    from batchgen.sampling.params import SamplingParams

    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len=4096, scheduling_policy=policy)
    params = SamplingParams(max_tokens=max_tokens)
    source = iter(enumerate(prompts))
    exhausted, computed, steps = False, 0, 0
    while True:
        while not exhausted and len(sched.waiting) < sched.lookahead:
            item = next(source, None)
            if item is None:
                exhausted = True
                break
            i, prompt = item
            group = SequenceGroup(str(i), None, list(prompt), params, arrival=i + 1)
            group.seqs.append(Sequence(prompt))
            assert sched.add(group) is None
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        steps += 1
        for seq, n in out.scheduled:
            if n > 1 or seq.num_output_tokens == 0 or seq.num_computed_tokens + 1 < seq.num_tokens:
                computed += n
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1, 0.0)
                if seq.num_output_tokens >= max_tokens:
                    sched.free_seq(seq)
        for group in list(sched.running):
            if group.is_finished:
                sched.finish_group(group)
    return {"prefill_tokens": computed, "steps": steps, "evictions": bm.num_evictions,
            "preemptions": sched.num_preemptions}


def policy_sweep(tokenizer, log: Callable[[str], None]) -> list[dict]:
    rows = []
    for num_prefixes in SIM_PREFIXES:
        prompts = few_shot_prompts(tokenizer, num_prefixes=num_prefixes, seed=1)
        for kv, blocks in SIM_KV_BLOCKS.items():
            row: dict[str, Any] = {"num_prefixes": num_prefixes, "kv": kv, "num_blocks": blocks,
                                   "prompt_tokens": sum(map(len, prompts))}
            for policy in ("fcfs", "prefix"):
                row[policy] = simulate(prompts, policy, blocks)
            log(f"  {num_prefixes} prefixes, KV {kv}: prefill tokens fcfs {row['fcfs']['prefill_tokens']}, "
                f"prefix {row['prefix']['prefill_tokens']} (of {row['prompt_tokens']})")
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- the timed part
def peers(use_vllm: bool) -> dict[str, dict]:
    options = {"batchgen": {"kv_cache_memory": GIB},
               "batchgen_nocache": {"as": "batchgen", "kv_cache_memory": GIB, "enable_prefix_caching": False},
               "hf_generate": {"batch_size": HF_BATCH}}
    if use_vllm:
        options["vllm"] = {"kv_gib": 1}
    return options


def prefill_tokens(run: dict) -> int | None:
    if "engine_stats" in run:
        return run["engine_stats"]["num_prefill_tokens"]
    return run.get("prefill_tokens")


def summarize(result: dict) -> None:
    """Per peer: rows/s (median, min, max) and prefill tokens; batchgen's rows/s over each
    peer's, of the medians and paired per repeat."""
    rows = result["rows"]
    per: dict[str, dict[int, float]] = {}
    for name, rec in result["peers"].items():
        runs = [r for r in rec.get("runs", []) if "seconds" in r]
        rates = {r["repeat"]: rows / r["seconds"] for r in runs}
        per[name] = rates
        rec["summary"] = ({"ok": True, "runs": len(runs), "rows_per_s_median": statistics.median(rates.values()),
                           "rows_per_s_min": min(rates.values()), "rows_per_s_max": max(rates.values()),
                           "seconds_median": statistics.median(r["seconds"] for r in runs),
                           "prefill_tokens": prefill_tokens(runs[-1])}
                          if runs else {"ok": False})
    ours = per.get("batchgen", {})
    result["ratios"] = {}
    for name, rates in per.items():
        if name == "batchgen" or not rates or not ours:
            continue
        paired = [ours[k] / rates[k] for k in ours if k in rates]
        result["ratios"][name] = {
            "of_medians": statistics.median(ours.values()) / statistics.median(rates.values()),
            "paired_median": statistics.median(paired) if paired else None,
            "paired_min": min(paired) if paired else None, "paired_all": paired}


def run_part(args, out: Path, log: Callable[[str], None], vllm_status: Callable[[], tuple[bool, str]],
             machine: Callable[[], dict], save: Callable[[str, dict, Path], None]) -> dict:
    """``python -m bench --parts prefix``; ``--merge`` adds this invocation's repeats to
    ``prefix.json``'s."""
    import json

    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model
    from bench import runner

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    num_rows = 32 if args.quick else ROWS
    prompts = few_shot_prompts(tok, num_rows)
    use_vllm, why = (False, "disabled with --no-vllm") if args.no_vllm else vllm_status()
    log(f"prefix: {num_rows} rows, shared prefix {common_prefix(prompts)} tokens, vLLM: {why}")
    previous = json.loads((out / "prefix.json").read_text()) if args.merge and (out / "prefix.json").is_file() else None
    result: dict = previous or {
        "workload": f"few-shot arithmetic, {num_rows} rows, {NUM_SHOTS} solved examples shared",
        "rows": num_rows, "max_tokens": MAX_TOKENS, "mode": "greedy", "threads": args.threads,
        "shared_prefix_tokens": common_prefix(prompts), "prompt_tokens": sum(map(len, prompts)),
        "mean_prompt_tokens": sum(map(len, prompts)) / num_rows,
        "vllm": {"available": use_vllm, "detail": why}, "machine": machine(), "peers": {}, "invocations": []}
    chosen = peers(use_vllm)
    if args.peers:
        chosen = {k: v for k, v in chosen.items() if k in args.peers}
    first = 1 + max((r["repeat"] for rec in result["peers"].values() for r in rec.get("runs", [])), default=-1)
    log(f"prefix: {list(chosen)} x {args.repeats} repeats (repeat numbers from {first})")
    res = runner.interleaved(chosen, prompts, {"kind": "greedy"}, MAX_TOKENS, args.repeats, args.log_dir,
                             args.threads, run_timeout=args.run_timeout * 2, seed=first, on_event=log)
    for name, rec in res.items():
        for r in rec["runs"]:
            r["repeat"] += first
            r.pop("outputs", None)
        old = result["peers"].get(name, {"runs": []})
        rec["runs"] = old["runs"] + rec["runs"]
        result["peers"][name] = rec
    result["invocations"].append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "peers": list(chosen),
                                  "repeats": args.repeats, "loadavg_at_start": machine().get("loadavg_at_start")})
    summarize(result)
    if not args.merge or "policy_simulation" not in result:
        log("prefix: scheduling policy simulation (no model)")
        result["policy_simulation"] = {"rows": ROWS, "max_tokens": MAX_TOKENS, "block_size": 16,
                                       "max_num_batched_tokens": 2048, "max_num_seqs": 256,
                                       "results": policy_sweep(tok, log)}
    save("prefix", result, out)
    return result


# ---------------------------------------------------------------------- report
def plot(out: Path, result: dict | None) -> list[str]:
    if not result or not result.get("peers"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in PEER_LABELS if result["peers"].get(n, {}).get("summary", {}).get("ok")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    s = [result["peers"][n]["summary"] for n in names]
    ys = [x["rows_per_s_median"] for x in s]
    ax.barh(range(len(names)), ys, xerr=[[y - x["rows_per_s_min"] for y, x in zip(ys, s)],
                                          [x["rows_per_s_max"] - y for y, x in zip(ys, s)]], capsize=3)
    ax.set_yticks(range(len(names)), [PEER_LABELS[n] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("rows/s, end to end (median, min–max)")
    ax.set_title(f"{result['rows']} few-shot rows, {result['shared_prefix_tokens']}-token shared prefix", fontsize=9)
    ax = axes[1]
    pf = [x["prefill_tokens"] or 0 for x in s]
    ax.barh(range(len(names)), pf, color="tab:orange")
    ax.axvline(result["prompt_tokens"], color="grey", ls="--", lw=1, label="prompt tokens")
    ax.set_yticks(range(len(names)), ["" for _ in names])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(left=1000)
    for y, v in enumerate(pf):
        ax.text(v, y, f" {v:,}", va="center", fontsize=8)
    ax.set_xlabel("prompt tokens computed (log)")
    ax.legend(fontsize=8)
    ax.set_title("prefill work", fontsize=9)
    sim = (result.get("policy_simulation") or {}).get("results", [])
    ax = axes[2]
    for kv, style in (("512 MiB", "-"), ("1 GiB", ":")):
        rr = [r for r in sim if r["kv"] == kv]
        for policy, color in (("fcfs", "tab:red"), ("prefix", "tab:green")):
            ax.plot([r["num_prefixes"] for r in rr], [r[policy]["prefill_tokens"] for r in rr], style, marker="o",
                    color=color, label=f"{policy}, KV {kv}")
    if sim:
        ax.axhline(sim[0]["prompt_tokens"], color="grey", ls="--", lw=1, label="prompt tokens")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("different few-shot prefixes, rows interleaved")
    ax.set_ylabel("prompt tokens computed")
    ax.set_title("scheduling policy (scheduler replay, no model)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "prefix.png", dpi=120)
    plt.close(fig)
    return ["prefix.png"]


def summary_md(result: dict | None) -> str:
    if not result or not result.get("peers"):
        return ""
    L = [f"## A shared few-shot prefix ({result['workload']}; greedy, max_tokens {result['max_tokens']}; "
         f"{result['threads']} thread per peer)\n",
         f"{result['rows']} rows of {result['mean_prompt_tokens']:.0f} prompt tokens on average "
         f"({result['prompt_tokens']} in all), of which the first {result['shared_prefix_tokens']} are the same "
         "for every row; all rows are queued at once. Runs: " +
         "; ".join(f"{i['at']} UTC ({i['repeats']} repeat(s), load {fmt_load(i)})" for i in result["invocations"]) +
         ".\n",
         "| peer | rows/s (median) | min–max | prompt tokens computed | batchgen / peer (paired median, min) |",
         "| --- | --- | --- | --- | --- |"]
    for name, lab in PEER_LABELS.items():
        rec = result["peers"].get(name)
        if not rec:
            continue
        s = rec.get("summary", {})
        if not s.get("ok"):
            L.append(f"| {lab} | failed: {rec.get('status', '')[:150]} | | | |")
            continue
        r = result["ratios"].get(name)
        ratio = f"{r['paired_median']:.2f}× ({r['paired_min']:.2f}×)" if r and r.get("paired_median") else "–"
        L.append(f"| {lab} | {s['rows_per_s_median']:.2f} | {s['rows_per_s_min']:.2f}–{s['rows_per_s_max']:.2f} | "
                 f"{s['prefill_tokens']:,} | {ratio} |")
    sim = (result.get("policy_simulation") or {}).get("results", [])
    if sim:
        L.append("\nScheduling policy, replayed without a model (256 rows, every row generating "
                 f"{result['policy_simulation']['max_tokens']} tokens; prompt tokens computed, of "
                 f"{sim[0]['prompt_tokens']:,}):\n")
        L.append("| prefixes, interleaved | KV | fcfs | prefix (default) |")
        L.append("| --- | --- | --- | --- |")
        for r in sim:
            L.append(f"| {r['num_prefixes']} | {r['kv']} | {r['fcfs']['prefill_tokens']:,} | "
                     f"{r['prefix']['prefill_tokens']:,} |")
    return "\n".join(L) + "\n"


def fmt_load(invocation: dict) -> str:
    load = invocation.get("loadavg_at_start")
    return f"{load[0]:.1f}" if load else "?"
