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

from bench.report_plots import plots, waste_rows
from bench.report_summary import summary_md

MIB = 2**20
BUDGET = 256 * MIB
S_MAX = 2048


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


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
