"""Batch-1..4 (GEMV) and few-row speed of the quantized kernel, A/B against another commit's
``quant.c``: ``python -m bench.quant_gemv [--base REV] [--rows 1,2,4] [--threads 1,2]``.

Each (type, shape) streams weights from memory: enough copies of the layer to exceed the last
level cache, called one after the other, so that GB/s is weight bytes read from DRAM per second
(set against ``bench/roof_read.c``'s read bandwidth, measured in the same run). ``--base`` builds
``quant.c`` as of that git revision beside this tree's, and the two run in interleaved blocks
(the machine may be shared and loaded: the ratio is the figure, not the absolute). GOP/s counts
a multiply-add as 2.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from batchgen.kernels.cpu import c_build, quant
from batchgen.kernels.cpu.quant_formats import QUANT_FORMATS
from bench.quant_kernel import random_raw
from bench.roofline import read_bandwidth

HERE = Path(__file__).resolve().parent
SHAPES = {"Q4_K": [(2048, 2048), (8192, 2048)], "Q8_0": [(2048, 2048), (8192, 2048)],
          "Q4_1": [(2048, 2048), (8192, 2048)], "Q6_K": [(2048, 8192)], "Q5_K": [(2048, 2048)],
          "Q5_0": [(2048, 2048)], "Q4_0": [(2048, 2048)]}
LOCAL_INCLUDE = re.compile(r'#include\s+"([^"]+)"')  # as c_build.local_headers reads them
STREAM_BYTES = 384 << 20  # 12x the 32 MiB L3: the Zen 4's L3 kept part of a 3x working set (96 MiB) read in turn


def base_library(rev: str, tmp: Path, isa: str):  # noqa: ANN201 - a ctypes library
    """``quant.c`` and the local headers it includes (``pool.h``, ``quant_*.h``, nested ones too)
    as of ``rev``, built and loaded beside this tree's."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          cwd=HERE, check=True).stdout.strip()
    todo, seen = ["quant.c"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = subprocess.run(["git", "show", f"{rev}:batchgen/kernels/cpu/{name}"], capture_output=True,
                              text=True, cwd=root, check=True).stdout
        (tmp / name).write_text(text)
        todo += LOCAL_INCLUDE.findall(text)
    return c_build.load_library(f"quant.c at {rev}", tmp / "quant.c", quant._declare, quant.ISAS[isa],
                               accept=quant._runs_here, tag=f"base-{isa}")


def layers(qtype, n: int, k: int) -> list[torch.Tensor]:  # noqa: ANN001
    raw = random_raw(qtype, n, k, seed=1, fast=True)
    packed = quant.pack_panels(raw.view(n, -1), qtype)
    copies = max(1, -(-STREAM_BYTES // packed.numel()))
    return [packed.clone() for _ in range(copies)]


def timed(lib, weights: list[torch.Tensor], kid: int, m: int, n: int, k: int, seconds: float) -> float:  # noqa: ANN001
    """Seconds per layer call, the best of 3 rounds over every copy."""
    x = torch.randn(m, k)
    y = torch.empty(m, n)
    best = float("inf")
    for _ in range(3):
        calls, t0 = 0, time.perf_counter()
        while calls < len(weights) or time.perf_counter() - t0 < seconds:
            w = weights[calls % len(weights)]
            lib.batchgen_quant_linear(x.data_ptr(), k, m, k, w.data_ptr(), kid, n, None, y.data_ptr(), n)
            calls += 1
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None, help="a git revision to compare against (interleaved)")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default=",".join(SHAPES))
    ap.add_argument("--isa", default="native")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds (interleaved)")
    ap.add_argument("--largest", action="store_true", help="only each type's largest shape")
    args = ap.parse_args()
    from gguf import GGMLQuantizationType as Q

    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    bw = read_bandwidth(threads, buffer_bytes=256 << 20, repeats=3)
    print("read bandwidth:", ", ".join(f"{t}t {bw[f'{t}t_gbs']:.1f} GB/s" for t in threads), flush=True)
    libs = {"new": quant.load_quant(args.isa)}
    tmp = Path(tempfile.mkdtemp())
    try:
        if args.base:
            libs = {"base": base_library(args.base, tmp, args.isa), **libs}
        for name in args.types.split(","):
            qtype = Q[name]
            kid = QUANT_FORMATS[qtype].kernel_id
            for n, k in SHAPES[name][-1:] if args.largest else SHAPES[name]:
                ws = layers(qtype, n, k)
                nbytes = ws[0].numel()
                for t in threads:
                    c_build.set_num_threads(t)
                    for m in rows:
                        best = {lab: float("inf") for lab in libs}
                        for _ in range(args.rounds):
                            for lab, lib in libs.items():
                                best[lab] = min(best[lab], timed(lib, ws, kid, m, n, k, args.seconds))
                        text = "  ".join(f"{lab} {nbytes / s / 1e9:5.1f} GB/s {2 * m * n * k / s / 1e9:6.1f} GOP/s"
                                         for lab, s in best.items())
                        ratio = f"  new/base {best['base'] / best['new']:.2f}x" if "base" in best else ""
                        print(f"{name} {n}x{k} {t}t m={m:3d}: {text}{ratio}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
