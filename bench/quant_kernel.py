"""The quantized linear kernel against the float kernels: ``python -m bench.quant_kernel --out FILE``.

Peers, on the same shapes, rows and threads (batchgen's pool; torch on one thread):

* ``quant``: :class:`batchgen.kernels.cpu.quant.QuantizedLinear`, this CPU's build
  (AVX512-VNNI where it has it); ``quant_<isa>``: the same layer on the other builds named by
  ``--isas`` (default ``avx2,avxvnni``: AVX2 alone, and AVX2 with AVX-VNNI's 256-bit
  ``vpdpbusd``), each where it runs here; the JSON's ``peer_isas`` says what each peer ran;
* ``fp32`` / ``bf16``: :class:`batchgen.kernels.cpu.linear.PackedLinear` on float32 / bfloat16
  weights of the same shape (bfloat16 input).

Shapes: SmolLM2-135M's layers as the engine runs them (q/k/v packed as one 576 -> 960 GEMM,
gate/up as one 576 -> 3072, o 576 -> 576, down 1536 -> 576, in Q4_1 like the embedded file;
lm_head 576 -> 49152 in Q8_0, the file's tied embedding), and a ~1B Llama's (hidden 2048, ffn
8192, 32 heads of 64 and 8 KV heads: q/k/v 2048 -> 3072, o 2048 -> 2048, gate/up 2048 -> 16384,
down 8192 -> 2048) in Q4_K (down in Q6_K, as Q4_K_M files hold half of them), in Q8_0, and in
Q5_K and Q5_0 throughout. At 1, 8, 32 and 64 rows. Random weights (``gguf``'s quantizer where it has one, random valid blocks for
the K-quants: the kernel's time does not depend on the values).

Timing: the peers' blocks of back-to-back calls (at least ``--block-seconds``) interleaved,
``--repeats`` blocks each; the fastest block is the figure, the spread is the slowest over the
fastest. One layer's weight stays in the caches from call to call (the compute side); the
``sweeps`` run every layer of the model once, in order, on separate weights (SmolLM2: 30 layers
and lm_head; the 1B: 8 layers quantized, 4 in float: enough to exceed this machine's caches for
the float peers, the number of layers is in the JSON), which is where the bytes read per
weight count.

Ceilings (``bench/quant_peak.c``): tight loops of 12 independent chains with no memory traffic
-- ``vpdpbusd`` zmm (int8, AVX512-VNNI), ``vpmaddubsw``+``vpaddw`` ymm (int8, AVX2), float32
FMA on zmm and ymm, and ``vdpbf16ps`` zmm (bfloat16 dot products, AVX512-BF16) -- on 1 and 2
threads at once. GOP/s counts a multiply-add as 2 operations
everywhere.

The machine may be shared: the JSON records the load average before and after, and each
block's CPU time over its wall time (``cpu_share``: 1.0 when the threads had their cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

ROWS = (1, 8, 32, 64)
SMOL = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down_proj": (576, 1536)}
LLAMA_1B = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down_proj": (2048, 8192)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def layer_specs() -> list[dict]:
    from gguf import GGMLQuantizationType as Q

    specs = [{"model": "smollm2", "layer": name, "n": n, "k": k, "qtype": Q.Q4_1} for name, (n, k) in SMOL.items()]
    specs.append({"model": "smollm2", "layer": "lm_head", "n": 49152, "k": 576, "qtype": Q.Q8_0})
    for qt in (Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q5_0):
        for name, (n, k) in LLAMA_1B.items():
            q = Q.Q6_K if qt == Q.Q4_K and name == "down_proj" else qt
            specs.append({"model": "llama_1b", "layer": name, "n": n, "k": k, "qtype": q})
    return specs


def random_raw(qtype, n: int, k: int, seed: int, fast: bool = False) -> torch.Tensor:  # noqa: ANN001
    """GGUF bytes of a random [n, k] weight: ``gguf``'s quantizer on random weights where it has
    one (unless ``fast``), else random valid blocks (random quants, finite fp16 scales)."""
    import gguf
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    from batchgen.kernels.cpu.quant_formats import QUANT_FORMATS

    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0) and not fast:
        return torch.from_numpy(gguf.quants.quantize(rng.normal(0, 0.02, (n, k)).astype(np.float32), qtype))
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // bs, ts), dtype=np.uint8)
    for off in QUANT_FORMATS[qtype].halves:
        blocks[:, off:off + 2] = rng.normal(0, 1e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def timed_blocks(fns: dict, repeats: int, block_seconds: float, threads: int) -> dict[str, dict]:
    """Each function's blocks of back-to-back calls, interleaved: per function the fastest
    block's time per call, the median, the slowest/fastest ratio, and the CPU share."""
    for fn in fns.values():
        fn()
    per: dict[str, list[float]] = {name: [] for name in fns}
    share: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            calls, c0, t0 = 0, time.process_time(), time.perf_counter()
            while calls < 2 or time.perf_counter() - t0 < block_seconds:
                fn()
                calls += 1
            wall = time.perf_counter() - t0
            per[name].append(wall / calls)
            share[name].append((time.process_time() - c0) / (wall * threads))
    return {name: {"best_s": min(v), "median_s": statistics.median(v), "spread": max(v) / min(v),
                   "cpu_share": statistics.median(share[name])} for name, v in per.items()}


def peaks(threads_list: list[int], seconds: float = 0.3) -> dict:
    """The tight-loop ceilings (see the module docstring), GOP/s."""
    from batchgen.kernels.cpu import c_build

    lib, _ = c_build.build("the ceiling loops", Path(__file__).resolve().parent / "quant_peak.c", [])
    flags = c_build.cpu_flags() or frozenset()
    loops = {"int8_vnni512": ("bench_vnni512", 12 * 64, "avx512_vnni"),
             "int8_maddubs_avx2": ("bench_maddubs", 12 * 32, "avx2"),
             "fp32_fma512": ("bench_fma512", 12 * 16, "avx512f"),
             "fp32_fma256": ("bench_fma256", 12 * 8, "fma"),
             "bf16_dot512": ("bench_bf16dot512", 12 * 32, "avx512_bf16")}
    out: dict = {}
    for name, (sym, macs, flag) in loops.items():
        if flag not in flags:
            out[name] = None
            continue
        fn = getattr(lib, sym)
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int]
        fn(1000, 1)
        iters = 1 << 16  # calibrate one call to ~seconds/3
        while True:
            t0 = time.perf_counter()
            fn(iters, 1)
            if time.perf_counter() - t0 > seconds / 3:
                break
            iters *= 2
        for t in threads_list:
            best = 0.0
            for _ in range(3):
                ts = [threading.Thread(target=fn, args=(iters, i + 2)) for i in range(t)]
                t0 = time.perf_counter()
                for th in ts:
                    th.start()
                for th in ts:
                    th.join()
                best = max(best, 2 * macs * iters * t / (time.perf_counter() - t0) / 1e9)
            out[f"{name}_{t}t"] = best
    return out


def make_peers(spec: dict, isas: tuple[str, ...], float_peers: bool = True, fast: bool = False) -> dict:
    """The peers of one layer: ``quant`` (native), ``quant_<isa>`` for each of ``isas``, and the
    float layers unless not ``float_peers``."""
    from batchgen.kernels.cpu.linear import PackedLinear
    from batchgen.kernels.cpu.quant import QuantizedLinear

    n, k, qt = spec["n"], spec["k"], spec["qtype"]
    raw = random_raw(qt, n, k, seed=n + k, fast=fast)
    peers = {"quant": QuantizedLinear(raw, qt, n, k)}
    for isa in isas:
        peers[f"quant_{isa}"] = QuantizedLinear(raw, qt, n, k, isa=isa)
    if float_peers:
        lin = torch.nn.Linear(k, n, bias=False)
        peers["fp32"] = PackedLinear(lin)
        peers["bf16"] = PackedLinear(lin.to(torch.bfloat16))
    return peers


def layers_part(rows_list, threads: int, repeats: int, block_seconds: float, isas: tuple[str, ...],
                only: set[str] | None = None) -> list[dict]:
    """Each layer of :func:`layer_specs` (those named ``model:layer`` or ``model:layer:QTYPE`` in
    ``only``, if given) against its peers at each row count."""
    out = []
    for spec in layer_specs():
        names = {f"{spec['model']}:{spec['layer']}", f"{spec['model']}:{spec['layer']}:{spec['qtype'].name}"}
        if only and not names & only:
            continue
        peers = make_peers(spec, isas)
        for m in rows_list:
            x = torch.randn(m, spec["k"])
            xb = x.to(torch.bfloat16)
            fns = {name: (lambda p=p: p(xb)) if name == "bf16" else (lambda p=p: p(x)) for name, p in peers.items()}
            got = timed_blocks(fns, repeats, block_seconds, threads)
            ops = 2 * m * spec["n"] * spec["k"]
            row = {"model": spec["model"], "layer": spec["layer"], "n": spec["n"], "k": spec["k"],
                   "qtype": spec["qtype"].name, "rows": m, "threads": threads,
                   "peers": {name: {**g, "gops": ops / g["best_s"] / 1e9} for name, g in got.items()}}
            row["quant_vs_fp32"] = got["fp32"]["best_s"] / got["quant"]["best_s"]
            row["quant_vs_bf16"] = got["bf16"]["best_s"] / got["quant"]["best_s"]
            out.append(row)
            print(f"{threads}t {spec['model']:8s} {spec['layer']:9s} {spec['qtype'].name:4s} rows {m:3d}: "
                  + "  ".join(f"{name} {v['gops']:6.1f}" for name, v in row["peers"].items())
                  + f"  GOP/s; quant/fp32 {row['quant_vs_fp32']:.2f}x", flush=True)
        del peers
    return out


def sweep_part(rows_list, threads: int, repeats: int) -> list[dict]:
    """Every layer once, in order, on separate weights (see the module docstring)."""
    from gguf import GGMLQuantizationType as Q

    out = []
    models = {
        "smollm2": ([{"n": n, "k": k, "qtype": Q.Q4_1} for _ in range(30) for n, k in SMOL.values()]
                    + [{"n": 49152, "k": 576, "qtype": Q.Q8_0}], 1),
        "llama_1b_q4_k": ([{"n": n, "k": k, "qtype": Q.Q6_K if name == "down_proj" else Q.Q4_K}
                           for _ in range(8) for name, (n, k) in LLAMA_1B.items()], 2),
        "llama_1b_q8_0": ([{"n": n, "k": k, "qtype": Q.Q8_0} for _ in range(8) for n, k in LLAMA_1B.values()], 2),
    }
    for model, (specs, float_every) in models.items():
        quant = [make_peers(s, (), float_peers=False, fast=True)["quant"] for s in specs]
        # the float peers on every float_every-th layer (the 1B in float32 would not fit beside the rest)
        fl = None
        if model != "llama_1b_q8_0":
            fl = [make_peers({**s, "qtype": Q.Q4_0}, (), float_peers=True, fast=True) for s in specs[::float_every]]
            for p in fl:
                del p["quant"]
        for m in rows_list:
            xs = {k: torch.randn(m, k) for k in {s["k"] for s in specs}}
            xb = {k: v.to(torch.bfloat16) for k, v in xs.items()}
            fns = {"quant": lambda: [layer(xs[layer.in_features]) for layer in quant]}
            if fl is not None:
                fns["fp32"] = lambda: [p["fp32"](xs[p["fp32"].in_features]) for p in fl]
                fns["bf16"] = lambda: [p["bf16"](xb[p["bf16"].in_features]) for p in fl]
            got = timed_blocks(fns, repeats, 0.0, threads)
            ops = {"quant": 2 * m * sum(s["n"] * s["k"] for s in specs)}
            if fl is not None:
                ops["fp32"] = ops["bf16"] = 2 * m * sum(s["n"] * s["k"] for s in specs[::float_every])
            weight_bytes = {"quant": sum(int(layer.packed.numel()) for layer in quant)}
            if fl is not None:
                weight_bytes["fp32"] = sum(p["fp32"].packed_weight.numel() * 4 for p in fl)
                weight_bytes["bf16"] = sum(p["bf16"].packed_weight.numel() * 2 for p in fl)
            row = {"model": model, "rows": m, "threads": threads, "layers": len(specs),
                   "float_layers": len(specs[::float_every]) if fl is not None else 0,
                   "peers": {name: {**g, "gops": ops[name] / g["best_s"] / 1e9, "weight_bytes": weight_bytes[name],
                                    "gbytes_per_s": weight_bytes[name] / g["best_s"] / 1e9} for name, g in got.items()}}
            if fl is not None:
                row["quant_vs_fp32"] = row["peers"]["quant"]["gops"] / row["peers"]["fp32"]["gops"]
                row["quant_vs_bf16"] = row["peers"]["quant"]["gops"] / row["peers"]["bf16"]["gops"]
            out.append(row)
            print(f"{threads}t sweep {model:14s} rows {m:3d}: "
                  + "  ".join(f"{name} {v['gops']:6.1f} GOP/s ({v['gbytes_per_s']:.1f} GB/s)" for name, v in row["peers"].items()),
                  flush=True)
        del quant, fl
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = max(r["threads"] for r in result["layers"])
    groups = [("smollm2", "Q4_1"), ("llama_1b", "Q4_K"), ("llama_1b", "Q8_0")]
    fig, axes = plt.subplots(1, len(groups), figsize=(15, 4.6), sharey=True)
    colors = {"quant": "tab:green", "quant_avxvnni": "tab:cyan", "quant_avx2": "tab:olive",
              "fp32": "tab:blue", "bf16": "tab:purple"}
    for ax, (model, qt) in zip(axes, groups):
        rows = [r for r in result["layers"] if r["threads"] == threads and r["model"] == model
                and (r["qtype"] == qt or (qt == "Q4_K" and r["qtype"] == "Q6_K") or (model == "smollm2"))]
        labels = sorted({(r["layer"], r["qtype"]) for r in rows}, key=lambda t: [s["layer"] for s in layer_specs()].index(t[0]))
        x = range(len(labels) * len(ROWS))
        for i, peer in enumerate(colors):
            vals = []
            for (layer, q) in labels:
                for m in ROWS:
                    hit = [r for r in rows if r["layer"] == layer and r["qtype"] == q and r["rows"] == m]
                    vals.append(hit[0]["peers"].get(peer, {}).get("gops", 0) if hit else 0)
            width = 0.8 / len(colors)
            ax.bar([j + (i - (len(colors) - 1) / 2) * width for j in x], vals, width=width, color=colors[peer], label=peer)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{layer}\n{m}" if m == ROWS[0] else str(m) for layer, _ in labels for m in ROWS],
                           fontsize=7)
        ceiling = result["peaks"].get(f"int8_vnni512_{threads}t") or result["peaks"].get(f"int8_maddubs_avx2_{threads}t")
        if ceiling:
            ax.axhline(ceiling, color="tab:red", linestyle="--", linewidth=1, label="int8 ceiling (tight loop)")
        ax.set_title(f"{model} {qt}, {threads} threads")
        ax.set_yscale("log")
    axes[0].set_ylabel("GOP/s (layer rows x columns x 2 / time)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"quantized linear vs float kernels, {result['cpu']} (shared machine; load {result['loadavg_before'][0]:.1f})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-seconds", type=float, default=0.1)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--layers", default="", help="only these layers, as model:layer or model:layer:QTYPE "
                    "(e.g. llama_1b:qkv:Q8_0), comma-separated; default all")
    ap.add_argument("--isas", default="avx2,avxvnni",
                    help="the kernel's other builds (quant.ISAS) timed beside the native one, where they run here")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    args = ap.parse_args()
    png = args.out.with_suffix(".png")
    if args.plot_only:
        plot(json.loads(args.out.read_text()), png)
        return
    from batchgen.kernels.cpu import c_build, quant

    why = quant.unsupported_reason()
    if why is not None:
        raise SystemExit(f"the quantized CPU kernel cannot run here: {why}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    threads_list = [int(t) for t in args.threads.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    isas = []
    for isa in filter(None, args.isas.split(",")):
        try:
            quant.load_quant(isa)  # ValueError for a name quant.ISAS lacks
        except c_build.CpuKernelError as exc:
            print(f"no quant_{isa} peer: {str(exc).splitlines()[0]}", flush=True)
            continue
        isas.append(isa)
    isas = tuple(isas)
    result: dict = {"cpu": cpu_name(), "kernel_isa": quant.kernel_isa(), "cores": os.cpu_count(),
                    "peer_isas": {"quant": quant.kernel_isa(), **{f"quant_{i}": quant.kernel_isa(i) for i in isas}},
                    "loadavg_before": os.getloadavg(), "threads": threads_list, "rows": rows_list,
                    "repeats": args.repeats, "block_seconds": args.block_seconds, "layers": [], "sweeps": []}
    result["peaks"] = peaks(threads_list)
    print("builds:", result["peer_isas"], flush=True)
    print("ceilings:", {k: round(v, 1) for k, v in result["peaks"].items() if v}, flush=True)
    for t in threads_list:
        c_build.set_num_threads(t)
        result["layers"] += layers_part(rows_list, t, args.repeats, args.block_seconds, isas,
                                        set(filter(None, args.layers.split(","))))
        if not args.no_sweep:
            result["sweeps"] += sweep_part(rows_list, t, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    result["loadavg_after"] = os.getloadavg()
    best = max(r["peers"]["quant"]["gops"] for r in result["layers"] if r["threads"] == max(threads_list))
    result["quant_best_layer_gops"] = best
    args.out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, png)
    except ImportError:
        print("matplotlib is missing (pip install 'batchgen[bench]'): no plot")


if __name__ == "__main__":
    main()
