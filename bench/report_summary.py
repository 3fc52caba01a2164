"""``summary.md`` for ``bench/report.py``: one function a section, each returning its Markdown
lines when its part has run (none otherwise), and :func:`summary_md`, which puts them in order;
with the cell formatting they share.
"""

from __future__ import annotations

import math
import re
from typing import Any

from bench.report_plots import PEER_LABELS, label, waste_rows

MIB = 2**20


def fmt(x: Any, spec: str = ".1f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def timed_out(status: str) -> float | None:
    """The time limit a run hit, read from its status ("... no answer within 600 s ..."), else None."""
    m = re.search(r"no answer within (\d+) s", status or "")
    return float(m.group(1)) if m else None


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


def intro(tp: dict | None) -> list[str]:
    """The run's setting: the model, the machine, the workload, merged reruns."""
    if not tp:
        return []
    L: list[str] = []
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
    return L


def throughput_table(tp: dict | None) -> list[str]:
    """Tokens/s of each peer in each mode, and batchgen's ratios."""
    if not tp:
        return []
    L: list[str] = []
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
    return L


def throughput_notes(tp: dict | None) -> list[str]:
    """Peak RSS and KV bytes, the greedy agreement with HF, and why a peer did not run."""
    if not tp:
        return []
    L: list[str] = []
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
    return L


def scaling_section(scaling: dict | None) -> list[str]:
    """W32 and W256 against HF generate at a 256 MiB KV budget."""
    if not (scaling and scaling.get("workloads")):
        return []
    L: list[str] = []
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
    return L


def waste_and_sharing(tp: dict | None, sharing: dict | None) -> list[str]:
    """The memory section's heading, KV waste per cache and the sharing saving."""
    L: list[str] = []
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
    return L


def concurrency_and_blocks(conc: dict | None, lengths: dict | None, bsz: dict | None) -> list[str]:
    """Concurrency in 256 MiB, waste against length and the block-size ablation."""
    L: list[str] = []
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
    return L


def profile_sections(prof: dict | None, prof_beam: dict | None) -> list[str]:
    """Where a decode step's time goes (greedy, and beam width 4)."""
    L: list[str] = []
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
    return L


def kernel_section(lk: dict | None) -> list[str]:
    """The CPU linear kernel against torch's GEMM."""
    if not (lk and lk.get("results")):
        return []
    L: list[str] = []
    L.append(f"## CPU linear kernel against torch's GEMM ({lk['threads']} thread, SmolLM2's shapes, "
             "fastest of interleaved calls)\n")
    L.append(linear_kernel_table(lk))
    L.append("")
    return L


def summary_md(tp, sharing, bsz, scaling, prof, conc, made: list[str], prof_beam: dict | None = None,
               lengths: dict | None = None, lk: dict | None = None) -> str:
    """``summary.md``: every section whose part has run, then the figures drawn."""
    L = ["# Benchmark summary\n"]
    L += intro(tp) + throughput_table(tp) + throughput_notes(tp) + scaling_section(scaling)
    L += waste_and_sharing(tp, sharing) + concurrency_and_blocks(conc, lengths, bsz)
    L += profile_sections(prof, prof_beam) + kernel_section(lk)
    if made:
        L.append("Plots: " + ", ".join(f"[{m}]({m})" for m in made) + ".\n")
    return "\n".join(L) + "\n"
