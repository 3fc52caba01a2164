"""Plots and the Markdown summary, built from ``bench/results/*.json`` (whatever parts exist).

Also derives the memory analyses that need no run of their own:

* KV waste: from the step observer of batchgen's W32 runs (paged vs dense S_max) and from HF
  ``generate``'s final dense cache (static batch).
* Concurrency in a 256 MiB budget: sequences of W32's average final length (prompt + its
  generated tokens) that fit in paged blocks, against a dense cache of S_max = 2048 slots per
  sequence; plus the peak concurrency batchgen reached in the scaling run at 256 MiB.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MIB = 2**20
BUDGET = 256 * MIB
S_MAX = 2048
PEER_LABELS = {"batchgen": "batchgen", "hf_generate": "HF generate (static)",
               "hf_generate_batch": "HF generate_batch (CB)", "vllm": "vLLM CPU"}
MODE_LABELS = {"greedy": "greedy", "n4": "n=4 sampling", "beam4": "beam width 4"}


def label(mode_key: str) -> str:
    """``n4`` -> "n=4 sampling"; a tagged rerun such as ``n4_rerun`` -> "n=4 sampling (rerun)"."""
    import re

    base, _, tag = mode_key.partition("_")
    tag = re.sub(r"(\d)([a-z])", r"\1 \2", tag)
    return MODE_LABELS.get(base, base) + (f" ({tag.replace('_', ' ')})" if tag else "")


def timed_out(status: str) -> float | None:
    """The time limit a run hit, read from its status ("... no answer within 600 s ..."), else None."""
    import re

    m = re.search(r"no answer within (\d+) s", status or "")
    return float(m.group(1)) if m else None


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(x: Any, spec: str = ".1f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def concurrency(throughput: dict | None, scaling: dict | None) -> dict | None:
    """Sequences that fit in 256 MiB: paged (W32's real lengths) vs dense S_max."""
    if not throughput:
        return None
    g = throughput["modes"].get("greedy", {}).get("peers", {}).get("batchgen", {})
    setup, runs = g.get("setup", {}), g.get("runs", [])
    if not setup or not runs:
        return None
    bpb, bs = setup["bytes_per_block"], setup["block_size"]
    bpt = bpb // bs
    from bench.workload import w32_prompts

    prompts = w32_prompts()
    gen_per_seq = runs[0].get("mean_tokens_per_sequence", throughput["max_tokens"])
    mean_blocks = sum(math.ceil((len(p) + gen_per_seq) / bs) for p in prompts) / len(prompts)
    blocks = BUDGET // bpb
    res = {"budget_bytes": BUDGET, "bytes_per_token": bpt, "block_size": bs,
           "mean_final_tokens_per_seq": sum(len(p) for p in prompts) / len(prompts) + gen_per_seq,
           "paged_blocks_in_budget": blocks, "paged_mean_blocks_per_seq": mean_blocks,
           "paged_seqs": int(blocks // mean_blocks),
           "dense_smax_seqs": int(BUDGET // (S_MAX * bpt)),
           "dense_wmax_seqs": int(BUDGET // ((max(len(p) for p in prompts) + throughput["max_tokens"]) * bpt))}
    res["paged_over_dense_smax"] = res["paged_seqs"] / max(1, res["dense_smax_seqs"])
    if scaling:
        for wname, w in scaling.get("workloads", {}).items():
            runs = w["peers"].get("batchgen", {}).get("runs", [])
            if runs and runs[0].get("observer"):
                res.setdefault("measured", {})[wname] = {
                    "max_concurrent_seqs": runs[0]["observer"]["max_concurrent_seqs"],
                    "num_preemptions": runs[0]["engine_stats"]["num_preemptions"],
                    "max_tokens": scaling["max_tokens"], "kv_cache_memory": scaling["batchgen_kv_cache_memory"]}
    return res


def plots(out: Path, tp: dict | None, sharing: dict | None, bsz: dict | None, scaling: dict | None,
          prof: dict | None, conc: dict | None, prof_beam: dict | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if tp:
        modes = list(tp["modes"])
        peers = ["batchgen", "hf_generate", "hf_generate_batch", "vllm"]
        fig, ax = plt.subplots(figsize=(min(13.0, 1.6 * len(modes) + 2), 4.6))
        width = 0.2
        for i, p in enumerate(peers):
            xs, ys, lo, hi = [], [], [], []
            for j, m in enumerate(modes):
                s = tp["modes"][m]["peers"].get(p, {}).get("summary", {})
                if s.get("ok"):
                    xs.append(j + (i - 1.5) * width)
                    ys.append(s["tokens_per_s_median"])
                    lo.append(s["tokens_per_s_median"] - s["tokens_per_s_min"])
                    hi.append(s["tokens_per_s_max"] - s["tokens_per_s_median"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=PEER_LABELS[p])
        ax.set_xticks(range(len(modes)), [label(m).replace(" (", "\n(") for m in modes], fontsize=8)
        ax.set_ylabel("generated tokens/s (median, min–max)")
        ax.set_title(f"W32, max_tokens {tp['max_tokens']}, SmolLM2-135M fp32, CPU, {tp['threads']} thread(s)/peer")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=120)
        plt.close(fig)
        made.append("throughput.png")
    if sharing and sharing.get("rows"):
        rows = [r for r in sharing["rows"] if "saving_per_request_mean" in r]
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for kind, color in (("n", "tab:blue"), ("beam", "tab:orange")):
            rr = [r for r in rows if r["kind"] == kind]
            ax.plot([r["k"] for r in rr], [100 * r["saving_per_request_mean"] for r in rr], "o-", color=color,
                    label="parallel sampling (n)" if kind == "n" else "beam search (width)")
        ax.axhspan(6.1, 9.8, color="tab:blue", alpha=0.12, label="paper, sampling (Alpaca)")
        ax.axhspan(37.6, 55.2, color="tab:orange", alpha=0.12, label="paper, beams (Alpaca)")
        ax.set_xticks(sorted({r["k"] for r in rows}))
        ax.set_xlabel("n / beam width")
        ax.set_ylabel("KV blocks saved by sharing, %")
        ax.set_title(f"Sharing saving (1 - physical/logical), W32, max_tokens {sharing['max_tokens']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "sharing.png", dpi=120)
        plt.close(fig)
        made.append("sharing.png")
    waste = waste_rows(tp)
    if waste or conc:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        if waste:
            labels = [w[0] for w in waste]
            axes[0].barh(labels, [100 * w[1] for w in waste], color=["tab:green" if "batchgen" in w[0] else "tab:red" for w in waste])
            for y, w in enumerate(waste):
                axes[0].text(100 * w[1] + 1, y, f"{100 * w[1]:.1f}%", va="center", fontsize=8)
            axes[0].set_xlim(0, 110)
            axes[0].set_xlabel("reserved but unused KV slots, %")
            axes[0].set_title("KV waste, W32 greedy")
        if conc:
            names = ["paged\n(batchgen)", "dense\nS_max = 2048", "dense, longest\nprompt + max_tokens"]
            vals = [conc["paged_seqs"], conc["dense_smax_seqs"], conc["dense_wmax_seqs"]]
            axes[1].bar(names, vals, color=["tab:green", "tab:red", "tab:gray"])
            for x, v in enumerate(vals):
                axes[1].text(x, v, str(v), ha="center", va="bottom")
            axes[1].set_ylabel("sequences that fit")
            axes[1].set_title("Concurrency in 256 MiB of KV (W32 lengths)")
            axes[1].tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=120)
        plt.close(fig)
        made.append("memory.png")
    if bsz and bsz.get("rows"):
        rows = [r for r in bsz["rows"] if "tokens_per_s" in r]
        if rows:
            fig, ax1 = plt.subplots(figsize=(6.5, 3.8))
            x = [r["block_size"] for r in rows]
            ax1.plot(x, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue", label="tokens/s")
            ax1.set_xscale("log", base=2)
            ax1.set_xticks(x, [str(v) for v in x])
            ax1.set_xlabel("block size (tokens)")
            ax1.set_ylabel("tokens/s (1 run each)", color="tab:blue")
            ax2 = ax1.twinx()
            ax2.plot(x, [100 * r["observer"]["paged_waste_mean"] for r in rows], "s--", color="tab:red", label="waste")
            ax2.set_ylabel("KV waste, % (mean over steps)", color="tab:red")
            ax1.set_title("Block-size ablation, batchgen, W32 greedy")
            fig.tight_layout()
            fig.savefig(out / "blocksize.png", dpi=120)
            plt.close(fig)
            made.append("blocksize.png")
    if prof and prof.get("timers_share"):
        profiles = [("greedy", prof)] + ([("beam width 4", prof_beam)] if prof_beam and prof_beam.get("timers_share") else [])
        names = list(prof["timers_share"])
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        pretty = {"schedule": "scheduler", "prepare": "input packing", "copy_blocks": "copy-on-write copies",
                  "attention": "paged attention ops\n(cache write, decode kernel,\nprefill SDPA)",
                  "model_other": "rest of the model forward\n(matmuls, norms, RoPE, MLP)",
                  "sampling": "sampling / beam step", "python_other": "Python bookkeeping"}
        height = 0.8 / len(profiles)
        for i, (mode_label, p) in enumerate(profiles):
            share = p["timers_share"]
            ys = [y + (i - (len(profiles) - 1) / 2) * height for y in range(len(names))]
            vals = [100 * share.get(k, 0.0) for k in names]
            ax.barh(ys, vals, height=height, label=f"{mode_label}: {p['step_seconds_median'] * 1000:.0f} ms/step")
            for y, v in zip(ys, vals):
                ax.text(v + 0.5, y, f"{v:.1f}%", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), [pretty.get(k, k) for k in names])
        ax.tick_params(axis="y", labelsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 105)
        ax.set_xlabel("% of a decode step (median)")
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"batchgen decode step, W32 (attention backend: {prof.get('attention_backend', 'torch')})")
        fig.tight_layout()
        fig.savefig(out / "profile.png", dpi=120)
        plt.close(fig)
        made.append("profile.png")
    if scaling and scaling.get("workloads"):
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        wl = list(scaling["workloads"])
        for i, p in enumerate(["batchgen", "hf_generate"]):
            ys = [scaling["workloads"][w]["peers"].get(p, {}).get("summary", {}).get("tokens_per_s_median") for w in wl]
            xs = [j + (i - 0.5) * 0.35 for j in range(len(wl))]
            ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], 0.35, label=PEER_LABELS[p])
        ax.set_xticks(range(len(wl)), [f"{w} ({scaling['workloads'][w]['num_prompts']} prompts)" for w in wl])
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"Scaling, greedy, max_tokens {scaling['max_tokens']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "scaling.png", dpi=120)
        plt.close(fig)
        made.append("scaling.png")
    return made


def waste_rows(tp: dict | None) -> list[tuple[str, float]]:
    if not tp:
        return []
    rows = []
    for m in ("greedy", "n4", "beam4"):
        rec = tp["modes"].get(m, {})
        runs = rec.get("peers", {}).get("batchgen", {}).get("runs", [])
        if runs and runs[0].get("observer"):
            o = runs[0]["observer"]
            rows.append((f"batchgen paged, {label(m)}", o["paged_waste_mean"]))
            if m == "greedy":
                rows.append((f"dense S_max=2048, {label(m)}", o["dense_smax_waste_mean"]))
        hw = rec.get("hf_static_batch_waste")
        if hw and hw.get("waste") is not None:
            rows.append((f"HF static batch, {label(m)}", hw["waste"]))
    return rows


def summary_md(tp, sharing, bsz, scaling, prof, conc, made: list[str], prof_beam: dict | None = None,
               lengths: dict | None = None, lk: dict | None = None) -> str:
    L: list[str] = []
    L.append("# Benchmark summary\n")
    if tp:
        mach = tp.get("machine", {})
        L.append(f"SmolLM2-135M-Instruct, fp32, CPU ({mach.get('cpu_count')} cores, shared with other jobs; "
                 f"load average at start {fmt((mach.get('loadavg_at_start') or [None])[0], '.1f')}), "
                 f"{tp['threads']} torch thread per peer, every peer in its own process. "
                 f"W32 = 32 chat prompts (22–119 tokens), max_tokens {tp['max_tokens']}. Absolute tokens/s are noisy "
                 "on this shared machine; the ratios are taken within one run, with peers interleaved per repeat. "
                 f"Run at {mach.get('utc')}.\n")
        if tp.get("reruns"):
            L.append("Rows with a tag in brackets come from other invocations merged into the same file "
                     "(`--tag ... --merge`), each with its own peers interleaved: " +
                     ", ".join(f"{r['mode']} finished {r['at']} UTC ({', '.join(r['peers'])})" for r in tp["reruns"]) +
                     ". Compare ratios within a row, not tokens/s across rows: the machine's load changed "
                     "between runs.\n")
        L.append("## Throughput on W32 (generated tokens/s, median over repeats)\n")
        L.append("| mode | prompts | repeats | batchgen | HF generate (static) | HF generate_batch (CB) | vLLM CPU | batchgen / HF generate | batchgen / vLLM |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for m, rec in tp["modes"].items():
            cells = []
            for p in ("batchgen", "hf_generate", "hf_generate_batch", "vllm"):
                pr = rec["peers"].get(p)
                if pr is None:
                    cells.append("not run")
                elif pr.get("summary", {}).get("ok"):
                    cells.append(fmt(pr["summary"]["tokens_per_s_median"]))
                else:
                    st = pr.get("status", "failed")
                    limit = timed_out(st)
                    if st.startswith("unsupported"):
                        cells.append("unsupported")
                    elif limit:
                        cells.append(f"timed out (no result in {limit:.0f} s)")
                    else:
                        cells.append("failed (see notes)")
            r = rec.get("ratios", {})
            hf = r.get("hf_generate", {})
            vl = r.get("vllm", {})
            vcell = f"{fmt(vl.get('of_medians'), '.2f')}×" if vl else "–"
            limit = timed_out(rec["peers"].get("vllm", {}).get("status", ""))
            ours = rec["peers"].get("batchgen", {}).get("summary", {})
            if limit and ours.get("ok"):
                vcell = f"> {limit / ours['seconds_median']:.1f}× (by wall time)"
            L.append(f"| {label(m)} | {rec.get('num_prompts', 32)} | {rec['repeats']} | " + " | ".join(cells) +
                     f" | {fmt(hf.get('of_medians'), '.2f')}{'×' if hf else ''} | {vcell} |")
        L.append("")
        rss = []
        for m, rec in tp["modes"].items():
            parts = []
            for p in ("batchgen", "hf_generate", "hf_generate_batch", "vllm"):
                pr = rec["peers"].get(p, {})
                if pr.get("peak_rss_mib"):
                    kv = pr.get("kv_bytes")
                    parts.append(f"{PEER_LABELS[p]} {pr['peak_rss_mib']:.0f} MiB RSS, KV {fmt(kv / MIB if kv else None, '.0f')} MiB")
            if parts:
                rss.append(f"* {label(m)}: " + "; ".join(parts))
        if rss:
            L.append("Peak RSS of each peer's process and the KV bytes it used (batchgen: peak blocks in use; "
                     "HF generate: its final dense cache; generate_batch and vLLM: their preallocated cache):\n")
            L += rss
            L.append("")
        g = tp["modes"].get("greedy", {})
        if g.get("greedy_agreement_vs_hf_generate"):
            a = g["greedy_agreement_vs_hf_generate"]
            L.append(f"Greedy outputs identical to HF generate's on {a['identical']}/{a['prompts']} prompts "
                     f"(mean common prefix {100 * a['mean_common_prefix_fraction']:.0f} %; HF's batch is left-padded, "
                     "so small numeric differences can flip a near-tie).\n")
        notes = []
        for m, rec in tp["modes"].items():
            for p, pr in rec["peers"].items():
                if pr.get("status", "ok") != "ok":
                    notes.append(f"* {label(m)}, {PEER_LABELS.get(p, p)}: {pr['status'][:400]}")
        v = tp.get("vllm", {})
        if not v.get("available"):
            notes.append(f"* ¹ vLLM not run: {v.get('detail')}")
        if notes:
            L.append("Notes:\n")
            L += notes
            L.append("")
    if scaling and scaling.get("workloads"):
        L.append(f"## Scaling (greedy, max_tokens {scaling['max_tokens']}; batchgen at a 256 MiB KV budget, "
                 "HF generate with the whole workload in one static batch)\n")
        L.append("| workload | batchgen tok/s | HF generate tok/s | ratio | batchgen peak running seqs | HF KV MiB |")
        L.append("| --- | --- | --- | --- | --- | --- |")
        for w, rec in scaling["workloads"].items():
            b = rec["peers"].get("batchgen", {})
            h = rec["peers"].get("hf_generate", {})
            obs = (b.get("runs") or [{}])[0].get("observer", {})
            L.append(f"| {w} ({rec['num_prompts']}) | {fmt(b.get('summary', {}).get('tokens_per_s_median'))} | "
                     f"{fmt(h.get('summary', {}).get('tokens_per_s_median'))} | "
                     f"{fmt(rec.get('ratios', {}).get('hf_generate', {}).get('of_medians'), '.2f')}× | "
                     f"{obs.get('max_concurrent_seqs', '–')} | {fmt((h.get('kv_bytes') or 0) / MIB, '.0f')} |")
        L.append("")
    L.append("## Memory\n")
    waste = waste_rows(tp)
    if waste:
        L.append("KV waste (reserved but unused token slots; batchgen and dense S_max: mean over engine steps; "
                 "HF: its final cache):\n")
        L.append("| cache | waste |")
        L.append("| --- | --- |")
        for name, w in waste:
            L.append(f"| {name} | {100 * w:.1f} % |")
        L.append("")
    if sharing and sharing.get("rows"):
        L.append(f"Sharing saving on W32 (max_tokens {sharing['max_tokens']}), 1 - physical/logical blocks per "
                 "request at its peak, averaged over requests (the paper: 6.1–9.8 % for sampling, 37.6–55.2 % for "
                 "beams, on Alpaca):\n")
        L.append("| mode | saving (mean per request) | saving (aggregate) | CoW copies | peak blocks |")
        L.append("| --- | --- | --- | --- | --- |")
        for r in sharing["rows"]:
            name = f"n = {r['k']}" if r["kind"] == "n" else f"beam width {r['k']}"
            if "error" in r:
                L.append(f"| {name} | failed: {str(r['error'])[:200]} | | | |")
            else:
                L.append(f"| {name} | {100 * r['saving_per_request_mean']:.1f} % | {100 * r['saving_aggregate']:.1f} % | "
                         f"{r['num_cow_copies']} | {r['peak_blocks_used']} |")
        L.append("")
    if conc:
        L.append(f"Concurrency in 256 MiB of KV ({conc['bytes_per_token']} bytes per token): paged "
                 f"{conc['paged_seqs']} sequences (W32's mean final length {conc['mean_final_tokens_per_seq']:.0f} tokens, "
                 f"{conc['paged_mean_blocks_per_seq']:.1f} blocks of {conc['block_size']}) against "
                 f"{conc['dense_smax_seqs']} with a dense cache of S_max = 2048 per sequence "
                 f"({conc['paged_over_dense_smax']:.0f}×); a dense cache sized to W32's longest prompt + max_tokens "
                 f"holds {conc['dense_wmax_seqs']}.")
        for w, m in conc.get("measured", {}).items():
            L.append(f" Measured: batchgen ran up to {m['max_concurrent_seqs']} sequences at once on {w} "
                     f"(max_tokens {m['max_tokens']}) in 256 MiB, with {m['num_preemptions']} preemptions.")
        L.append("")
    if lengths and lengths.get("rows"):
        L.append(f"KV waste against sequence length (batchgen, block size {lengths['block_size']}, "
                 f"{lengths['workload']}; mean over engine steps): the paged cache wastes only the unfilled "
                 "tail of each sequence's last block, so its share falls as sequences grow.\n")
        L.append("| max_tokens | mean final length (tokens) | paged waste (mean) | paged waste (at peak) | "
                 "dense S_max = 2048 waste (mean) |")
        L.append("| --- | --- | --- | --- | --- |")
        L += table_rows(lengths["rows"], "max_tokens", "observer", lambda r: [
            f"{r['mean_final_tokens']:.0f}", f"{100 * r['observer']['paged_waste_mean']:.1f} %",
            f"{100 * r['observer']['paged_waste_at_peak']:.1f} %",
            f"{100 * r['observer']['dense_smax_waste_mean']:.1f} %"])
        L.append("")
    if bsz and bsz.get("rows"):
        L.append("Block-size ablation (batchgen, W32 greedy, one run each):\n")
        L.append("| block size | tokens/s | KV waste (mean) | KV waste (at peak) | peak KV MiB |")
        L.append("| --- | --- | --- | --- | --- |")
        L += table_rows(bsz["rows"], "block_size", "tokens_per_s", lambda r: [
            f"{r['tokens_per_s']:.1f}", f"{100 * r['observer']['paged_waste_mean']:.1f} %",
            f"{100 * r['observer']['paged_waste_at_peak']:.1f} %", f"{r['kv_bytes'] / MIB:.0f}"])
        L.append("")
    for p in (prof, prof_beam):
        if p and p.get("timers_share"):
            backend = p.get("attention_backend", "torch")
            linear = p.get("linear_backend", "torch")
            L.append(f"## Profile of a decode step (batchgen, {p['workload']}, attention backend `{backend}`, "
                     f"linear backend `{linear}`)\n")
            L.append(f"Median decode step {p['step_seconds_median'] * 1000:.0f} ms: " +
                     ", ".join(f"{k} {100 * v:.1f} %" for k, v in p["timers_share"].items()) + ".")
            if p.get("profiler_self_cpu_share"):
                L.append(" torch.profiler (self CPU time of aten ops, and of the linear layers' ranges, which hold "
                         "the C GEMM; the C attention kernel is no aten op and shows only in the timers): " +
                         ", ".join(f"{k} {100 * v:.0f} %" for k, v in p["profiler_self_cpu_share"].items()) + ".")
            L.append("")
    if lk and lk.get("results"):
        L.append(f"## CPU linear kernel against torch's GEMM ({lk['threads']} thread, SmolLM2's shapes, "
                 "fastest of interleaved calls)\n")
        L.append(linear_kernel_table(lk))
        L.append("")
    if made:
        L.append("Plots: " + ", ".join(f"[{m}]({m})" for m in made) + ".\n")
    return "\n".join(L) + "\n"


def table_rows(rows: list[dict], key: str, ok_field: str, cells: Any) -> list[str]:
    """Markdown rows ``| row[key] | cells(row)... |``; a row without ``ok_field`` says it failed."""
    lines = []
    for r in rows:
        if ok_field in r:
            lines.append(f"| {r[key]} | " + " | ".join(cells(r)) + " |")
        else:
            lines.append(f"| {r[key]} | failed: {str(r.get('error'))[:200]} | | | |")
    return lines


def linear_kernel_table(lk: dict) -> str:
    """Markdown: one row per layer shape, one column per row count, cells "torch → cpu ms (×)"."""
    rows_list = lk["rows"]
    cells: dict[str, dict[int, str]] = {}
    for r in lk["results"]:
        cells.setdefault(r["layer"], {})[r["rows"]] = (
            f"{r['torch_ms']:.3g} → {r['cpu_ms']:.3g} ms ({r['speedup']:.2f}×)")
    lines = ["| layer | " + " | ".join(f"{m} rows" for m in rows_list) + " |",
             "| --- |" + " --- |" * len(rows_list)]
    for layer, by_rows in cells.items():
        lines.append(f"| {layer} | " + " | ".join(by_rows.get(m, "–") for m in rows_list) + " |")
    model = lk.get("model") or []
    if model:
        lines.append("| **whole model** (all layers in order, weights from memory) | " + " | ".join(
            next((f"{r['torch_ms']:.3g} → {r['cpu_ms']:.3g} ms ({r['speedup']:.2f}×)"
                  for r in model if r["rows"] == m), "–") for m in rows_list) + " |")
    return "\n".join(lines)


def merge_sharing(sharing: dict | None, tp: dict | None) -> dict | None:
    """Add the n=4 / beam 4 rows from the throughput runs when the sharing part skipped them."""
    if not tp:
        return sharing
    sharing = sharing or {"workload": tp["workload"], "max_tokens": tp["max_tokens"], "rows": []}
    have = {(r["kind"], r["k"]) for r in sharing["rows"]}
    for mode_name, kind in (("n4", "n"), ("beam4", "beam")):
        runs = tp["modes"].get(mode_name, {}).get("peers", {}).get("batchgen", {}).get("runs", [])
        if (kind, 4) in have or not runs or tp["max_tokens"] != sharing["max_tokens"]:
            continue
        r, st = runs[0], runs[0]["engine_stats"]
        sharing["rows"].append({"kind": kind, "k": 4, "from": "throughput run",
                                "saving_per_request_mean": r["saving_per_request_mean"],
                                "saving_aggregate": r["saving_aggregate"],
                                "physical_blocks": st["physical_blocks"], "logical_blocks": st["logical_blocks"],
                                "num_cow_copies": st["num_cow_copies"], "num_preemptions": st["num_preemptions"],
                                "peak_blocks_used": st["peak_blocks_used"], "tokens": r["tokens"]})
    sharing["rows"].sort(key=lambda r: (r["kind"] != "n", r["k"]))
    return sharing


def build(out: Path) -> None:
    """Write the plots and ``summary.md`` (and ``memory.json``) into ``out``."""
    tp, sharing, bsz = load(out, "throughput"), load(out, "sharing"), load(out, "blocksize")
    sharing = merge_sharing(sharing, tp)
    scaling, prof, prof_beam = load(out, "scaling"), load(out, "profile"), load(out, "profile_beam4")
    conc = concurrency(tp, scaling)
    memory = {"waste": [{"cache": n, "waste": w} for n, w in waste_rows(tp)], "concurrency": conc,
              "sharing": sharing}
    (out / "memory.json").write_text(json.dumps(memory, indent=1))
    from bench import prefix, scaleout, structured

    pref = load(out, "prefix")
    made = plots(out, tp, sharing, bsz, scaling, prof, conc, prof_beam)
    scaled = load(out, "scaleout")
    if scaled:
        scaleout.plot(out, scaled)
        made.append("scaleout.png")
    made += prefix.plot(out, pref)
    struct = load(out, "structured")
    made += structured.plot(out, struct)
    text = summary_md(tp, sharing, bsz, scaling, prof, conc, made, prof_beam, load(out, "lengths"),
                      load(out, "linear_kernel"))
    from bench import machine

    gguf_lines: list[str] = []
    if (out / "machine.json").is_file():
        from bench import gguf_rows

        if machine.plot(out):
            made.append("machine.png")
        rows = json.loads((out / "machine.json").read_text())["rows"]
        if machine.plot(out, keys=gguf_rows.gguf_keys(rows), name="machine_gguf.png", color=gguf_rows.color):
            made.append("machine_gguf.png")
        gguf_lines = gguf_rows.summary_lines(rows, out)
    from bench import roof_report

    roof = load(out, "roof")
    if roof and roof_report.plot(roof, out / "roof.png"):
        made.append("roof.png")
    scaled_lines = (scaleout.summary_lines(scaled) + machine.summary_lines(out) + gguf_lines
                    + roof_report.summary_lines(roof))
    scaled_text = "\n".join(scaled_lines).rstrip("\n") + "\n\n" if scaled_lines else ""
    struct_text = structured.summary_md(struct)
    (out / "summary.md").write_text(text + scaled_text + prefix.summary_md(pref)
                                    + ("\n" + struct_text if struct_text else ""))
    print(f"wrote {out / 'summary.md'} and {', '.join(made) or 'no plots'}")
