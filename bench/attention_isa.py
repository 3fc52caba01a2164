"""The CPU attention kernel's instruction-set builds side by side:
``python -m bench.attention_isa --out FILE [--old-rev REV]``.

On SmolLM2's attention shape and ``bench.attention_kernel``'s cases (decode of 30, 32 and 128
sequences, W32's prefill, a 2,048-token prompt, a 512-token chunk), one layer call of each kind,
float32 and bfloat16, by three builds of the kernel:

* ``old_avx2``: the source at ``--old-rev`` (``git show REV:batchgen/kernels/cpu/...``, the
  version whose AVX2 build had one vector dot product at a time and scalar exp, softmax and P·V),
  built with ``-mno-avx512f``: what an AVX2 + FMA CPU (an AMD EPYC) ran;
* ``avx2``: the working tree's source, ``-mno-avx512f``;
* ``native``: the working tree's source for everything this CPU has (AVX-512 where present).

All three give the same bits (``tests/kernels/test_avx2_parity.py``); this times them. Blocks
rotate over the builds (``--blocks`` times), and in a block float32 and bfloat16 calls alternate
(``--rounds`` each) after a warm-up, with a 64 MiB write before each timed call (K/V come from
memory, as in a model step). Times are the calling thread's CPU time by default (``--clock
thread``, one thread), which a loaded machine's descheduling does not inflate. Each build's speed against ``old_avx2`` is the ratio of block
medians, block by block (median and range). The machine's load average is recorded: on a shared
machine the absolute times move, the ratios of interleaved blocks less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.attention_kernel import HEAD_SIZE, HEADS, KV_HEADS, cases, make_case
from bench.quant_kernel import cpu_name

SOURCE = "paged_attention.c"
KERNEL_DIR = "batchgen/kernels/cpu"
_LOCAL_INCLUDE = re.compile(r'#include\s+"([^"]+)"')


def old_source(rev: str, folder: Path) -> Path:
    """The kernel source and the local headers it includes (those of that revision: the
    per-ISA headers since their split out of the source) at git revision ``rev``, in ``folder``."""
    root = Path(__file__).resolve().parent.parent
    todo, seen = [SOURCE], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = subprocess.run(["git", "show", f"{rev}:{KERNEL_DIR}/{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        (folder / name).write_text(text)
        todo.extend(_LOCAL_INCLUDE.findall(text))
    return folder / "paged_attention.c"


def load(source: Path, isa_flags: tuple[str, ...], tag: str):
    from batchgen.kernels.cpu import c_build, cpu_attention

    group = HEADS // KV_HEADS
    return c_build.load_library(f"the CPU attention kernel ({tag})", source, cpu_attention._declare_attention,
                               (f"-DHEAD_SIZE={HEAD_SIZE}", f"-DGROUP={group}", *isa_flags),
                               tag=f"h{HEAD_SIZE}-g{group}-{tag}")


def call(fn, case: dict, dtype: torch.dtype, out: torch.Tensor) -> None:
    from batchgen.kernels.cpu import cpu_attention

    q, k, v = case[f"q_{dtype}"], case[f"k_{dtype}"], case[f"v_{dtype}"]
    starts, code = case["starts"], cpu_attention.DTYPES[dtype]
    rc = fn(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), case["tables"].data_ptr(),
            None if starts is None else starts.data_ptr(), case["lens"].data_ptr(), case["lens"].shape[0],
            q.shape[0], KV_HEADS, case["block"], case["tables"].shape[1], q.stride(0), q.stride(1),
            HEAD_SIZE ** -0.5, k.shape[0], code, code, 0, 0.0)  # the caches' dtype; no window, no cap
    # (a build of a revision before the window and soft-cap arguments ignores the last ones; one
    # before the caches' own dtype code, 2026-12-05, reads that code as its window: compare such
    # a revision in float32 only, where the code is 0)
    assert rc == 0, rc



DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--old-rev", required=True, help="git revision of the old kernel source")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: the calling thread's CPU time (1 thread only; robust to a loaded "
                         "machine's descheduling), wall: perf_counter")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--cases", default=",".join(cases()))
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    return ap


def _time_case(args: argparse.Namespace, case: dict, fns: dict, clock) -> dict[str, list[list[float]]]:
    """Each build and dtype's call times, one list per block (the builds alternate block by
    block); every build's output is checked against the first build's, bit for bit."""
    flush = torch.zeros(16 * 2**20)
    outs = {d: torch.empty(case["q"].shape, dtype=dt) for d, dt in DTYPES.items()}
    same = {}
    times: dict[str, list[list[float]]] = {f"{b}_{d}": [] for b in fns for d in DTYPES}
    for _ in range(args.blocks):
        for bname, fn in fns.items():
            for dname, dtype in DTYPES.items():
                call(fn, case, dtype, outs[dname])  # warm-up
                ref = same.setdefault(dname, outs[dname].clone())
                assert torch.equal(outs[dname], ref), f"{bname} {dname}: other bits than the first build"
            block: dict[str, list[float]] = {d: [] for d in DTYPES}
            for _ in range(args.rounds):
                for dname, dtype in DTYPES.items():
                    flush.add_(1.0)
                    t0 = clock()
                    call(fn, case, dtype, outs[dname])
                    block[dname].append(clock() - t0)
            for dname, ts in block.items():
                times[f"{bname}_{dname}"].append(ts)
    return times


def _case_row(name: str, times: dict[str, list[list[float]]]) -> dict:
    """One case's row: each variant's median and its speed against the old AVX2 build of the
    same dtype, block by block (median and spread)."""
    row = {"case": name, "variants": {}}
    for vname, blocks in times.items():
        base = times["old_avx2_" + vname.rsplit("_", 1)[1]]
        ratios = [statistics.median(b0) / statistics.median(b) for b0, b in zip(base, blocks)]
        row["variants"][vname] = {"median_ms": statistics.median([x for b in blocks for x in b]) * 1e3,
                                  "speed_vs_old_avx2": statistics.median(ratios),
                                  "ratio_spread": [min(ratios), max(ratios)]}
    return row


def main() -> None:
    from batchgen.kernels.cpu import c_build

    args = _parser().parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    if args.clock == "thread" and args.threads != 1:
        raise SystemExit("--clock thread times the calling thread alone: use it with --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    c_build.set_num_threads(args.threads)
    here = Path(__file__).resolve().parent.parent / KERNEL_DIR / "paged_attention.c"
    with tempfile.TemporaryDirectory() as tmp:
        builds = {
            "old_avx2": load(old_source(args.old_rev, Path(tmp)), ("-mno-avx512f",), "old-avx2"),
            "avx2": load(here, ("-mno-avx512f",), "avx2"),
            "native": load(here, (), "native"),
        }
    fns = {name: lib.batchgen_paged_attention for name, lib in builds.items()}
    isa = {name: int(getattr(lib, "batchgen_attention_isa", lambda: -1)()) for name, lib in builds.items()}
    result = {"cpu": cpu_name(), "threads": args.threads, "clock": args.clock, "blocks": args.blocks, "rounds": args.rounds,
              "old_rev": args.old_rev, "isa_reported": isa, "loadavg_start": os.getloadavg(), "results": []}
    wanted = args.cases.split(",")
    for name, (lens, q_lens) in cases().items():
        if name not in wanted:
            continue
        case = make_case(lens, q_lens, seed=len(name))
        case["block"] = case["k"].shape[1]
        for dtype in DTYPES.values():
            for key in "qkv":
                case[f"{key}_{dtype}"] = case[key].to(dtype)
        row = _case_row(name, _time_case(args, case, fns, clock))
        result["results"].append(row)
        print(f"{name:12s} " + "  ".join(f"{v} {d['median_ms']:.3f} ms ({d['speed_vs_old_avx2']:.2f}x)"
                                         for v, d in row["variants"].items()), flush=True)
    result["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Each build's speed against the old AVX2 build, per case and dtype (median of the block
    ratios, the range as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    variants = [v for v in rows[0]["variants"] if not v.startswith("old_")]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [c + (i - (len(variants) - 1) / 2) * width for c in range(len(rows))]
        mid = [r["variants"][v]["speed_vs_old_avx2"] for r in rows]
        err = [[m - r["variants"][v]["ratio_spread"][0] for m, r in zip(mid, rows)],
               [r["variants"][v]["ratio_spread"][1] - m for m, r in zip(mid, rows)]]
        ax.bar(xs, mid, width, yerr=err, label=v.replace("_", " "))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("speed vs the old AVX2 build")
    ax.set_title(f"paged attention builds, {result['cpu']}, {result['threads']} thread(s)")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
