"""The suite's figures for ``bench/report.py``: one function a figure, each drawing its PNG
from a part's JSON when that part has run (``None`` otherwise), and :func:`plots`, which
draws them all; with the peer and mode labels they and the summary share.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PEER_LABELS = {"batchgen": "batchgen", "hf_generate": "HF generate (static)",
               "hf_generate_batch": "HF generate_batch (CB)", "vllm": "vLLM CPU"}
MODE_LABELS = {"greedy": "greedy", "n4": "n=4 sampling", "beam4": "beam width 4"}


def label(mode_key: str) -> str:
    """``n4`` -> "n=4 sampling"; a tagged rerun such as ``n4_rerun`` -> "n=4 sampling (rerun)"."""
    base, _, tag = mode_key.partition("_")
    tag = re.sub(r"(\d)([a-z])", r"\1 \2", tag)
    return MODE_LABELS.get(base, base) + (f" ({tag.replace('_', ' ')})" if tag else "")


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


def plot_throughput(plt: Any, out: Path, tp: dict | None) -> str | None:
    """The generation modes' tokens/s per peer (W32): ``throughput.png``, or None without the data."""
    if not tp:
        return None
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
    return "throughput.png"


def plot_sharing(plt: Any, out: Path, sharing: dict | None) -> str | None:
    """KV blocks saved by sharing, against the paper's ranges: ``sharing.png``, or None without the data."""
    if not (sharing and sharing.get("rows")):
        return None
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
    return "sharing.png"


def plot_memory(plt: Any, out: Path, tp: dict | None, conc: dict | None) -> str | None:
    """KV waste per run and W32's concurrency in 256 MiB: ``memory.png``, or None without the data."""
    waste = waste_rows(tp)
    if not (waste or conc):
        return None
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
    return "memory.png"


def plot_blocksize(plt: Any, out: Path, bsz: dict | None) -> str | None:
    """Tokens/s and KV waste by block size: ``blocksize.png``, or None without the data."""
    if not (bsz and bsz.get("rows")):
        return None
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
        return "blocksize.png"
    return None


def plot_profile(plt: Any, out: Path, prof: dict | None, prof_beam: dict | None) -> str | None:
    """Where a decode step's time goes, greedy (and beam width 4): ``profile.png``, or None without the data."""
    if not (prof and prof.get("timers_share")):
        return None
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
    return "profile.png"


def plot_scaling(plt: Any, out: Path, scaling: dict | None) -> str | None:
    """W32 and W256 tokens/s, batchgen against HF generate: ``scaling.png``, or None without the data."""
    if not (scaling and scaling.get("workloads")):
        return None
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
    return "scaling.png"


def plots(out: Path, tp: dict | None, sharing: dict | None, bsz: dict | None, scaling: dict | None,
          prof: dict | None, conc: dict | None, prof_beam: dict | None = None) -> list[str]:
    """Every figure whose data exists, into ``out``; the file names drawn."""
    import matplotlib  # a heavy import, only when figures are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = [plot_throughput(plt, out, tp), plot_sharing(plt, out, sharing), plot_memory(plt, out, tp, conc),
            plot_blocksize(plt, out, bsz), plot_profile(plt, out, prof, prof_beam),
            plot_scaling(plt, out, scaling)]
    return [name for name in made if name]
