"""``python -m bench --parts structured``: structured outputs (a JSON schema) on W32.

Peers, each in its own process, started together and interleaved per repeat (``bench.runner``),
at the same threads and dtype (fp32):

* ``batchgen_constrained``: batchgen's ``LLM.generate`` with every request constrained to
  :data:`SCHEMA` (``SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))``);
* ``batchgen``: the same engine and settings, unconstrained;
* ``hf_generate_xgrammar``: HF ``generate`` (static left-padded batch) with xgrammar's own
  processor, ``xgrammar.contrib.hf.LogitsProcessor`` (``bench.peers.hf_generate_xgrammar``);
* ``batchgen_same_lengths``: batchgen unconstrained, but each prompt generating exactly as many
  tokens as the constrained peer's output for it (``ignore_eos``, per-prompt ``max_tokens``; for
  n = 4 the mean of its samples), taken from one untimed constrained run before the repeats.
  A JSON record is shorter than free text, so the constrained run has fewer sequences running
  in its last steps and fewer tokens to spread the prefill over; this control does the same
  work without the grammar, so constrained / this is the grammar's own cost;
* ``hf_generate``: HF ``generate`` unconstrained (optional, ``--peers``), which shows what the
  processor costs inside HF.

The workload is W32 with one sentence added to each user turn that asks for the JSON record
(:data:`INSTRUCTION`; a model is asked for what the schema enforces, as a user would), the same
token ids for every peer. Modes: greedy and n = 4 sampling (temperature 0.8, top-p 0.95),
max_tokens 64. Reported
per peer: generated tokens/s (median and spread over repeats), the constrained peer's
throughput over each other peer's (paired per repeat, within one invocation), and the share of
returned sequences that are JSON (``json_valid``) and that the schema accepts
(``json_schema_valid``), checked with batchgen's own metrics. Greedy also reports how many
prompts batchgen constrained and HF + xgrammar answer with the same tokens.

``--merge`` adds an invocation's repeats to ``structured.json``; ratios pair repeats of the
same invocation only.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: An answer card for W32's questions: five fields, every one required, strings capped so that a
#: whole record fits in 64 tokens (SmolLM2 writes it in 31-54 tokens, greedy).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "answer": {"type": "string", "maxLength": 60},
        "level": {"enum": ["easy", "medium", "hard"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        "example": {"type": "boolean"},
    },
    "required": ["topic", "answer", "level", "confidence", "example"],
    "additionalProperties": False,
}
#: Appended to each W32 user turn, so that the model is asked for what the schema enforces.
INSTRUCTION = ("\nReply with one JSON object only, with the keys topic, answer (one short sentence), level (easy, "
               "medium or hard), confidence (0 to 10) and example (true or false).")
_TURN_END = "<|im_end|>\n<|im_start|>assistant\n"
MODES = {"greedy": {"kind": "greedy"}, "n4": {"kind": "sample", "n": 4, "temperature": 0.8, "top_p": 0.95}}
OURS = "batchgen_constrained"
PEER_LABELS = {"batchgen_constrained": "batchgen, constrained", "batchgen": "batchgen, unconstrained",
               "batchgen_same_lengths": "batchgen, unconstrained, same lengths",
               "hf_generate_xgrammar": "HF generate + xgrammar processor", "hf_generate": "HF generate, unconstrained"}
DEFAULT_PEERS = ["batchgen_constrained", "batchgen", "batchgen_same_lengths", "hf_generate_xgrammar"]
#: Keyword arguments of xgrammar's ``compile_json_schema`` for the HF peer: batchgen's own (compact JSON).
XGRAMMAR_OPTIONS: dict[str, Any] = {"any_whitespace": False}
MIB, GIB = 2**20, 2**30


def json_prompts(tokenizer: Any, num_prompts: int) -> list[list[int]]:
    """W32 with :data:`INSTRUCTION` at the end of each user turn, tokenised by the model's tokenizer.

    Raises:
        ValueError: a W32 record without the end of a user turn to extend.
    """
    from bench.workload import load_w32

    prompts = []
    for r in load_w32()[:num_prompts]:
        if _TURN_END not in r["text"]:
            raise ValueError(f"W32 record {r['index']}: no {_TURN_END!r} to put the instruction before")
        text = r["text"].replace(_TURN_END, INSTRUCTION + _TURN_END, 1)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def peers(mode_name: str, names: list[str], lengths: list[int] | None = None) -> dict[str, dict]:
    """Worker options of the chosen peers; the KV budget as in the throughput part."""
    budget = 256 * MIB if mode_name == "greedy" else GIB
    options = {"batchgen_constrained": {"as": "batchgen", "kv_cache_memory": budget, "json_schema": SCHEMA},
               "batchgen": {"kv_cache_memory": budget},
               "batchgen_same_lengths": {"as": "batchgen", "kv_cache_memory": budget, "lengths": lengths},
               "hf_generate_xgrammar": {"json_schema": SCHEMA, "grammar": XGRAMMAR_OPTIONS},
               "hf_generate": {}}
    return {n: options[n] for n in names}


def constrained_lengths(prompts: list[list[int]], mode: dict, max_tokens: int, seed: int, args: Any,
                        log: Callable[[str], None]) -> list[int]:
    """Per prompt, the tokens of the constrained peer's output (the mean over its n samples,
    rounded), from one untimed run in a worker of its own."""
    from bench import runner

    options = peers("greedy" if mode["kind"] == "greedy" else "n4", [OURS])[OURS]
    w = runner.start_worker(OURS, options, args.log_dir, args.threads)
    try:
        w.wait_ready(900)
        res = w.run(prompts, mode, max_tokens, seed, args.run_timeout)
    finally:
        w.close()
    if "outputs" not in res:
        raise RuntimeError(f"the constrained run for the lengths failed: {res.get('error') or res}")
    lengths = [round(statistics.fmean(len(s) for s in seqs)) for seqs in res["outputs"]]
    log(f"structured: constrained lengths {min(lengths)}-{max(lengths)}, {sum(lengths)} in all")
    return lengths


def validity(outputs: list[list[list[int]]], tokenizer: Any, max_tokens: int) -> dict[str, Any]:
    """The share of returned sequences that are JSON and that :data:`SCHEMA` accepts, judged by
    batchgen's ``json_valid`` / ``json_schema_valid`` scoring; and the share cut by max_tokens."""
    from batchgen.plugins.builtin_metrics import parse_json, schema_validator

    validator = schema_validator(SCHEMA)
    texts = [tokenizer.decode(seq, skip_special_tokens=True) for seqs in outputs for seq in seqs]
    parsed = [parse_json(t) for t in texts]
    n = len(texts) or 1
    return {"sequences": len(texts),
            "json_valid": sum(ok for ok, _ in parsed) / n,
            "schema_valid": sum(ok and validator.is_valid(v) for ok, v in parsed) / n,
            "at_max_tokens": sum(len(seq) >= max_tokens for seqs in outputs for seq in seqs) / n,
            "examples": texts[:3]}


def summarize(entry: dict) -> None:
    """Per peer: tokens/s summary over all runs; per other peer: constrained / peer, paired by
    repeat (repeat numbers are unique across invocations, so pairs never cross them)."""
    from bench import runner

    for rec in entry["peers"].values():
        rec["summary"] = runner.summarize(rec["runs"])
        runs = [r for r in rec["runs"] if "validity" in r]
        if runs:
            rec["validity"] = {k: statistics.fmean(r["validity"][k] for r in runs)
                               for k in ("json_valid", "schema_valid", "at_max_tokens")}
    ratios = runner.ratios(entry["peers"], ours=OURS)
    for r in ratios.values():
        paired = r.get("paired_all") or []
        r["paired_min"], r["paired_max"] = (min(paired), max(paired)) if paired else (None, None)
    entry["ratios"] = ratios


def run_part(args, out: Path, log: Callable[[str], None], machine: Callable[[], dict],
             save: Callable[[str, dict, Path], None], greedy_agreement: Callable[[list, list], dict]) -> dict:
    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model
    from bench import runner
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    prompts = json_prompts(tok, args.num_prompts)
    path = out / "structured.json"
    previous = json.loads(path.read_text()) if args.merge and path.is_file() else None
    result: dict = previous or {"workload": f"W32 ({len(prompts)} prompts) asking for JSON",
                                "max_tokens": args.max_tokens, "schema": SCHEMA, "instruction": INSTRUCTION,
                                "prompt_tokens": sum(map(len, prompts)), "machine": machine(), "modes": {}, "invocations": []}
    names = args.peers or DEFAULT_PEERS
    for mode_name in args.modes:
        if mode_name not in MODES:
            log(f"structured: mode {mode_name} skipped (greedy and n4 only)")
            continue
        key = f"{mode_name}_{args.threads}t"
        entry = result["modes"].setdefault(key, {"mode": MODES[mode_name], "threads": args.threads,
                                                 "num_prompts": len(prompts), "peers": {}, "lengths": []})
        first = 1 + max((r["repeat"] for rec in entry["peers"].values() for r in rec.get("runs", [])), default=-1)
        reps = args.repeats_greedy if mode_name == "greedy" else args.repeats
        lengths = (constrained_lengths(prompts, MODES[mode_name], args.max_tokens, first, args, log)
                   if "batchgen_same_lengths" in names else None)
        chosen = peers(mode_name, names, lengths)
        if lengths:
            entry.setdefault("lengths", []).append({"from_repeat": first, "lengths": lengths})
        log(f"structured {key}: {list(chosen)} x {reps} repeats (repeat numbers from {first})")
        res = runner.interleaved(chosen, prompts, MODES[mode_name], args.max_tokens, reps, args.log_dir,
                                 args.threads, run_timeout=args.run_timeout, seed=first, on_event=log)
        if mode_name == "greedy":
            a, b = res.get(OURS, {}).get("runs"), res.get("hf_generate_xgrammar", {}).get("runs")
            if a and b:
                entry.setdefault("agreement_vs_hf_xgrammar", []).append(
                    greedy_agreement(a[0]["outputs"], b[0]["outputs"]))
        for name, rec in res.items():
            for r in rec["runs"]:
                r["repeat"] += first
                r["validity"] = validity(r["outputs"], tok, args.max_tokens)
                outs = r.pop("outputs")
                r["num_sequences"] = sum(len(o) for o in outs)
                log(f"  {name} rep {r['repeat']}: valid JSON {r['validity']['json_valid']:.0%}, "
                    f"schema {r['validity']['schema_valid']:.0%}")
            old = entry["peers"].get(name, {"runs": []})
            rec["runs"] = old["runs"] + rec["runs"]
            entry["peers"][name] = rec
        summarize(entry)
        result["invocations"].append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": key, "peers": list(chosen),
                                      "repeats": reps, "loadavg_at_start": machine().get("loadavg_at_start")})
        save("structured", result, out)
    return result


# ---------------------------------------------------------------------- report
def mode_label(key: str) -> str:
    mode, _, threads = key.rpartition("_")
    return {"greedy": "greedy", "n4": "n=4 sampling"}.get(mode, mode) + f", {threads.rstrip('t')} thread(s)"


def plot(out: Path, result: dict | None) -> list[str]:
    """``structured.png``: tokens/s per peer and mode (median, min–max), and the schema-valid share."""
    if not result or not result.get("modes"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["modes"])
    names = [n for n in PEER_LABELS if any(n in result["modes"][k]["peers"] for k in keys)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        meds, lo, hi, valid = [], [], [], []
        for k in keys:
            s = result["modes"][k]["peers"].get(name, {}).get("summary", {})
            m = s.get("tokens_per_s_median") if s.get("ok") else None
            meds.append(m or 0)
            lo.append((m - s["tokens_per_s_min"]) if m else 0)
            hi.append((s["tokens_per_s_max"] - m) if m else 0)
            valid.append(100 * result["modes"][k]["peers"].get(name, {}).get("validity", {}).get("schema_valid", 0))
        xs = [j + i * width for j in range(len(keys))]
        axes[0].bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=PEER_LABELS[name])
        for x, k, m, h in zip(xs, keys, meds, hi):
            r = result["modes"][k].get("ratios", {}).get(name, {}).get("paired_median")
            if r:
                axes[0].text(x, m + h, f"{r:.2f}×", ha="center", va="bottom", fontsize=7)
        axes[1].bar(xs, valid, width, label=PEER_LABELS[name])
    for ax in axes:
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))], [mode_label(k) for k in keys],
                      fontsize=8)
    axes[0].set_ylabel("generated tokens/s (median, min–max)")
    axes[0].set_xlabel("over a bar: constrained / that peer (paired median)", fontsize=8)
    axes[0].set_title(f"{result['workload']}, max_tokens {result['max_tokens']}, fp32 CPU", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names), fontsize=8)
    axes[1].set_ylabel("% of sequences the schema accepts")
    axes[1].set_ylim(0, 105)
    axes[1].set_title("json_schema_valid", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out / "structured.png", dpi=120)
    plt.close(fig)
    return ["structured.png"]


def _load(invocation: dict) -> str:
    load = invocation.get("loadavg_at_start")
    return f"{load[0]:.1f}" if load else "?"


def summary_md(result: dict | None) -> str:
    if not result or not result.get("modes"):
        return ""
    fields = ", ".join(SCHEMA["properties"])
    L = [f"## Structured outputs ({result['workload']}, max_tokens {result['max_tokens']}; a JSON schema of "
         f"{len(SCHEMA['properties'])} fields: {fields})\n",
         "Runs: " + "; ".join(f"{i['at']} UTC ({i['mode']}, {i['repeats']} repeat(s), load {_load(i)})"
                              for i in result["invocations"]) + ".\n",
         "| mode | peer | tokens/s (median) | min–max | runs | constrained / peer (paired median, min–max) "
         "| JSON valid | schema valid | at max_tokens |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, entry in result["modes"].items():
        for name, lab in PEER_LABELS.items():
            rec = entry["peers"].get(name)
            if not rec:
                continue
            s = rec.get("summary", {})
            if not s.get("ok"):
                L.append(f"| {mode_label(key)} | {lab} | failed: {str(rec.get('status', ''))[:120]} | | | | | | |")
                continue
            r = entry.get("ratios", {}).get(name)
            ratio = (f"{r['paired_median']:.2f}× ({r['paired_min']:.2f}–{r['paired_max']:.2f})"
                     if r and r.get("paired_median") else "–")
            v = rec.get("validity", {})
            L.append(f"| {mode_label(key)} | {lab} | {s['tokens_per_s_median']:.1f} | {s['tokens_per_s_min']:.1f}–"
                     f"{s['tokens_per_s_max']:.1f} | {s['runs']} | {ratio} | {100 * v.get('json_valid', 0):.0f} % | "
                     f"{100 * v.get('schema_valid', 0):.0f} % | {100 * v.get('at_max_tokens', 0):.0f} % |")
    for key, entry in result["modes"].items():
        for a in entry.get("agreement_vs_hf_xgrammar", []):
            L.append(f"\n{mode_label(key)}: batchgen constrained and HF + xgrammar give the same tokens on "
                     f"{a['identical']}/{a['prompts']} prompts (mean common prefix "
                     f"{100 * a['mean_common_prefix_fraction']:.0f} %).")
    return "\n".join(L) + "\n"
