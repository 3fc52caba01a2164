"""The CPU attention kernel against the torch path: ``python -m bench.attention_kernel --out FILE``.

On SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, 16-token blocks),
one layer call of each kind a run makes:

* ``decode-30``: 30 sequences, contexts 80-159 (a W32 decode step some tokens in);
* ``decode-32``: 32 sequences, contexts 62-159 (W32's prompts plus some output);
* ``decode-128``: 128 sequences (32 prompts x 4 beams or samples), contexts 62-223;
* ``prefill-w32``: W32's whole prefill in one call, 32 prompts of 62-159 tokens;
* ``prefill-2k``: one 2,048-token prompt in one chunk;
* ``chunk-512``: a 512-token chunk after 1,536 cached tokens.

Variants: the torch path (``torch_attention.py``: gather the blocks, then SDPA) and the C kernel,
each in float32 and in bfloat16 (bfloat16 query and cache; the kernel computes in float32),
each at 1 thread and at ``--threads``. Threads are set as the engine sets them: the torch path
gets torch's intra-op threads; the kernel gets the pool's threads, with torch on one (torch's
OpenMP workers spin after a parallel region, on the cores the pool needs).

Timing: one block per (path, thread count), the blocks in turn, ``--blocks`` times over; in a
block, float32 and bfloat16 calls alternate, ``--rounds`` each, after an untimed warm-up. Before
every timed call a 64 MiB buffer is written, so that K/V come from memory as they do in a model
step (between two attention calls the step streams every weight of a layer); ``--no-flush``
leaves K/V in the caches, which times the kernel's arithmetic rather than the memory. The summary gives
each variant's median and fastest call, its speed relative to the float32 kernel on one
thread (the ratio of block medians, block by block: its median and spread), and its largest
difference from the float32 torch path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def make_case(lens: list[int], q_lens: list[int] | None, seed: int) -> dict:
    """Random cache and queries; ``q_lens`` None is a decode (one query per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for s, b in enumerate(blocks):
        tables[s, :b] = perm[at:at + b].to(torch.int32)
        at += b
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_SIZE)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    tokens = len(lens) if q_lens is None else sum(q_lens)
    # the query as attention layers hand it over: a [T, H, D] view of a [H, T, D] tensor
    q = torch.randn(HEADS, tokens, HEAD_SIZE, generator=gen).transpose(0, 1)
    starts = None
    if q_lens is not None:
        starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "tables": tables, "lens": torch.tensor(lens, dtype=torch.int32),
            "starts": starts}


def call(ops, case: dict, dtype: torch.dtype, workspace) -> torch.Tensor:
    q, k, v = case[f"q_{dtype}"], case[f"k_{dtype}"], case[f"v_{dtype}"]
    scale = HEAD_SIZE ** -0.5
    if case["starts"] is None:
        return ops.paged_decode_attention(q, k, v, case["tables"], case["lens"], scale, workspace=workspace)
    return ops.paged_prefill_attention(q, k, v, case["tables"], case["starts"], case["lens"], scale,
                                       workspace=workspace)


def cases() -> dict[str, tuple[list[int], list[int] | None]]:
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randint(62, 160, (32,), generator=gen).tolist()
    beams = torch.randint(62, 224, (128,), generator=gen).tolist()
    return {
        "decode-30": (torch.randint(80, 160, (30,), generator=gen).tolist(), None),
        "decode-32": (w32, None),
        "decode-128": (beams, None),
        "prefill-w32": (w32, w32),
        "prefill-2k": ([2048], [2048]),
        "chunk-512": ([2048], [512]),
    }


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
BASE = "cpu_f32_t1"  # the variant every speed is relative to


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="calls of each variant per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks of each thread count, alternating")
    ap.add_argument("--cases", default=",".join(cases()))
    ap.add_argument("--no-flush", action="store_true", help="leave K/V in the caches between calls")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    return ap


def _time_case(args: argparse.Namespace, case: dict, paths: dict, thread_counts: list[int],
               workspace: object) -> tuple[dict[str, list[list[float]]], dict[str, torch.Tensor]]:
    """Each variant's call times (one list per block: the paths and thread counts alternate
    block by block) and each path and dtype's output."""
    from batchgen.kernels.cpu import c_build

    flush = torch.zeros(16 * 2**20)
    times: dict[str, list[list[float]]] = {f"{p}_{d}_t{t}": [] for t in thread_counts for p in paths for d in DTYPES}
    outs = {}
    with torch.inference_mode():
        for _ in range(args.blocks):
            for t in thread_counts:
                for pname, ops in paths.items():
                    c_build.set_num_threads(t if pname == "cpu" else 1)
                    torch.set_num_threads(1 if pname == "cpu" else t)
                    time.sleep(0.05)  # let the other path's idle workers go to sleep
                    for dname, dtype in DTYPES.items():
                        outs[f"{pname}_{dname}"] = call(ops, case, dtype, workspace).float()
                    block: dict[str, list[float]] = {d: [] for d in DTYPES}
                    for _ in range(args.rounds):
                        for dname, dtype in DTYPES.items():
                            if not args.no_flush:
                                flush.add_(1.0)
                            t0 = time.perf_counter()
                            call(ops, case, dtype, workspace)
                            block[dname].append(time.perf_counter() - t0)
                    for dname, ts in block.items():
                        times[f"{pname}_{dname}_t{t}"].append(ts)
    return times, outs


def _case_row(name: str, lens: list[int], q_lens: list[int] | None, times: dict[str, list[list[float]]],
              outs: dict[str, torch.Tensor]) -> dict:
    """One case's row: every variant's median and fastest call, its speed against BASE block by
    block (median and spread) and its largest difference from the torch path in float32."""
    truth = outs["torch_f32"]
    row = {"case": name, "num_seqs": len(lens), "query_tokens": len(lens) if q_lens is None else sum(q_lens),
           "context_tokens": sum(lens), "variants": {}}
    for vname, blocks in times.items():
        flat = [x for b in blocks for x in b]
        ratios = [statistics.median(b0) / statistics.median(b) for b0, b in zip(times[BASE], blocks)]
        row["variants"][vname] = {
            "median_ms": statistics.median(flat) * 1e3, "min_ms": min(flat) * 1e3,
            "speed_vs_cpu_f32_t1": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "max_abs_diff_vs_torch_f32": (outs[vname.rsplit("_", 1)[0]] - truth).abs().max().item(),
        }
    return row


def main() -> None:
    from batchgen.kernels import get_ops, torch_attention
    from batchgen.kernels.cpu import unsupported_reason

    args = _parser().parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    why = unsupported_reason(torch.float32, HEAD_SIZE, HEADS, KV_HEADS)
    if why is not None:
        raise SystemExit(f"the CPU attention kernel cannot run here: {why}")
    paths = {"torch": torch_attention, "cpu": get_ops("cpu")}
    workspace = torch_attention.Workspace()
    thread_counts = sorted({1, args.threads})
    result: dict = {"threads": args.threads, "blocks": args.blocks, "rounds": args.rounds,
                    "flush": not args.no_flush,
                    "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                              "block_size": BLOCK}, "results": []}
    wanted = args.cases.split(",")
    for name, (lens, q_lens) in cases().items():
        if name not in wanted:
            continue
        case = make_case(lens, q_lens, seed=len(name))
        for dtype in DTYPES.values():
            for key in "qkv":
                case[f"{key}_{dtype}"] = case[key].to(dtype)
        times, outs = _time_case(args, case, paths, thread_counts, workspace)
        row = _case_row(name, lens, q_lens, times, outs)
        result["results"].append(row)
        print(f"{name:12s} " + "  ".join(f"{v} {d['median_ms']:.3f} ms ({d['speed_vs_cpu_f32_t1']:.2f}x)"
                                         for v, d in row["variants"].items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Median call time of every variant, per case (log scale), as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    variants = list(rows[0]["variants"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [c + (i - (len(variants) - 1) / 2) * width for c in range(len(rows))]
        ax.bar(xs, [r["variants"][v]["median_ms"] for r in rows], width, label=v.replace("_", " "))
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (median)")
    ax.set_title(f"paged attention on SmolLM2's shape: torch path vs the C kernel "
                 f"(1 and {result['threads']} threads{'' if result.get('flush', True) else ', K/V in cache'})")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
