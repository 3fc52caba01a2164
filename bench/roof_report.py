"""The roofline's table (the "Roofline" section of ``summary.md``) and its plot
(``roof.png``), from ``roof.json`` as :mod:`bench.roofline` writes it; and issue 35's target
for each row."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TARGETS = {"batch 1": ("of_bandwidth", 0.9, "≥ 90 % of read bandwidth"),
           "batch >= 32, prefill": ("of_ceiling", 0.6, "≥ 60 % of the int8 ceiling")}


def target_of(row: dict) -> tuple[str, float, str] | None:
    """Issue 35's target for a row: batch-1 decode against the read bandwidth; decode at batch
    ≥ 32 and prefill of a GGUF model against the int8 ceiling; none for the rest (the scoring
    rows' targets are against their peers: the scoring part)."""
    if row["kind"].startswith("rolling"):
        return None
    decode = row["kind"].startswith("decode")
    if decode and row["batch"] == 1:
        return TARGETS["batch 1"]
    if row["ceiling"] == "int8" and (not decode or row["batch"] >= 32):
        return TARGETS["batch >= 32, prefill"]
    return None


def summary_lines(result: dict | None) -> list[str]:
    """The roofline section of ``summary.md``."""
    if not result or "roof" not in result:
        return []
    roof, bw, c = result["roof"], result["bandwidth"], result["ceilings"]
    load = result.get("loadavg_before") or [float("nan")] * 3
    lines = ["## Roofline (`python -m bench --parts roof" + (" --quick" if result.get("quick") else "") + "`)", "",
             f"{result['cpu']} ({result['cores']} cores; {', '.join(result['isa'])}). **Shared machine**: load "
             f"average {load[0]:.1f} before, {(result.get('loadavg_after') or load)[0]:.1f} after, on "
             f"{result['cores']} cores, so every figure here is loose (best-of timings; medians in `roof.json`).", "",
             f"Read bandwidth (1 GiB buffer, {bw['kernel']}): {bw['1t_gbs']:.1f} GB/s on 1 thread, "
             f"{bw['2t_gbs']:.1f} GB/s on 2. Ceilings at 2 threads: int8 {roof['int8_gops']:.0f} GOP/s, float32 FMA "
             f"{roof['fp32_gops']:.0f} GFLOP/s (tight loops, `bench/quant_peak.c`); the float32 linear kernel "
             f"on one hot 576 -> 1536 layer at 128 rows: {c['fp32_kernel_layer_gflops']:.0f} GFLOP/s.", "",
             *_after_lines(result),
             *_reference_lines(result),
             "| workload | step | ms | ops/byte | weight GB/s (of read BW) | GOP/s (of ceiling) | bound | of roof "
             "| of the step's roof, attention in | roof: GB/s, GOP/s | CPU share | issue 35 target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r.get('kind', '')} | {r['error']} | | | | | | | | | |")
            continue
        target, used = target_of(r), r.get("roof", roof)
        met = "–" if target is None else f"{target[2]}: {'met' if r[target[0]] >= target[1] else 'not met'}"
        lines.append(f"| {r['workload']} | {r['kind']} | {r['step_s'] * 1e3:.1f} | {r['intensity_ops_per_byte']:.1f} "
                     f"| {r['weight_gbs']:.1f} ({r['of_bandwidth'] * 100:.0f} %) | {r['gops']:.0f} "
                     f"({r['of_ceiling'] * 100:.0f} % of {r['ceiling']}) | {r['bound']} | {r['of_roof'] * 100:.0f} % "
                     f"| {_step_roof(r)} | {used['bandwidth_gbs']:.1f}, {used[r['ceiling'] + '_gops']:.0f} "
                     f"| {r.get('cpu_share', float('nan')):.2f} | {met} |")
    return lines + ["", "Weight bytes and operations are the linear layers' (lm_head included, in a prefill on each "
                    "prompt's last position only); attention's KV reads are left out of the intensity. A rolling "
                    "perplexity window scores every position (the lm_head on every row) and its roof adds "
                    "attention's float32 work at the float32 ceiling to the linear layers' at theirs "
                    "(`bench/roof_scoring.py`): its GOP/s are the linear layers', its 'of roof' that sum's time over "
                    "the window's. The step's roof adds attention to the linear layers' bound in every row: its "
                    "K/V reads at the read bandwidth or its float32 work at the float32 ceiling, the slower "
                    "(`bench.roof_math.step_roof_fields`); what a step spends beyond both (norms, RoPE, sampling, "
                    "Python) counts against it. Each row is set against the roof (read "
                    "bandwidth, and its ceiling) measured just before its model ran. CPU "
                    "share: the process's CPU time over wall time x 2 threads during the row's run (1.0: both "
                    "cores to itself).", ""]


def _step_roof(row: dict) -> str:
    """The whole step's fraction of its roof, with its attention part's share of that bound."""
    if "of_step_roof" not in row:
        return "–"
    return (f"{row['of_step_roof'] * 100:.0f} % (attention {row['attention_bound_s'] / row['step_bound_s'] * 100:.0f} % "
            "of the bound)")


def _after_lines(result: dict) -> list[str]:
    after = result.get("roof_after")
    if not after:
        return []
    return [f"Measured again after the workloads (load {after['loadavg'][0]:.1f}): {after['bandwidth_gbs']:.1f} GB/s, "
            f"int8 {after['int8_gops']:.0f}, float32 {after['fp32_gops']:.0f} GOP/s.", ""]


def _reference_lines(result: dict) -> list[str]:
    ref, roof = result.get("reference"), result["roof"]
    if not ref or not ref.get("int8_gops"):
        return []
    load = (ref.get("loadavg_before") or [float("nan")])[0]
    return [f"For scale: the same loops on a calmer machine ({ref['source']}, load {load:.1f}) reached int8 "
            f"{ref['int8_gops']:.0f} and float32 {ref['fp32_gops']:.0f} GOP/s at 2 threads, so this run had about "
            f"{roof['int8_gops'] / ref['int8_gops'] * 100:.0f} % of the CPU it would have alone; each fraction "
            "below sets a step measured under that load against a roof measured under it.", ""]


def plot(result: dict, path: Path) -> bool:
    """Log-log roofline: the bandwidth line, the int8 and float32 ceilings, each workload a point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    roof, rows = result["roof"], [r for r in result["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(12.5, 5.8))
    fig.subplots_adjust(left=0.07, right=0.66, bottom=0.1, top=0.92)
    xs = np.logspace(-1, 3.5, 200)
    roofs = [roof] + [r.get("roof", roof) for r in rows]
    for name, color in (("int8", "tab:red"), ("fp32", "tab:blue")):
        hi = max(roofs, key=lambda f: f[f"{name}_gops"])
        lo = min(roofs, key=lambda f: f[f"{name}_gops"])
        for f, style, which in ((hi, "-", "highest"), (lo, "--", "lowest")):
            ax.plot(xs, np.minimum(f[f"{name}_gops"], xs * f["bandwidth_gbs"]), color=color, linewidth=1.3,
                    linestyle=style, label=f"{which} {name} roof measured: {f['bandwidth_gbs']:.0f} GB/s, "
                                           f"{f[f'{name}_gops']:.0f} GOP/s")
    for i, r in enumerate(rows, 1):  # numbered points, named in a column beside the axes
        color = "tab:red" if r["ceiling"] == "int8" else "tab:blue"
        x, y = r["intensity_ops_per_byte"], r["gops"]
        ax.scatter(x, y, marker="o" if r["ceiling"] == "int8" else "s", s=30, zorder=3, color=color)
        ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=8)
        fig.text(0.68, 0.9 - (i - 1) * 0.055, f"{i}: {r['workload']} {r['kind']}: {r['of_roof'] * 100:.0f} % "
                 f"of its roof ({r['bound']})", fontsize=8, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity: linear-layer ops / weight bytes per step")
    ax.set_ylabel("GOP/s (int8 or float32 ops of the linear layers)")
    load = result.get("loadavg_before") or [0.0]
    ax.set_title(f"roofline, {result['cpu']}, 2 threads (shared machine, load {load[0]:.1f}: loose figures)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
