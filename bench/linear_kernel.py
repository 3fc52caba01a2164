"""The CPU linear kernel against torch's GEMM: ``python -m bench.linear_kernel --out FILE``.

For SmolLM2-135M's layer shapes (q/o 576->576, k/v 576->192, gate/up 576->1536, down
1536->576, lm_head 576->49152) and row counts from a lone decode to a prefill, times
``F.linear`` (MKL) and :class:`batchgen.kernels.cpu.linear.PackedLinear` on the same random
float32 weights and input. The two are interleaved in blocks of back-to-back calls (at least
200 ms each), and each keeps its fastest block, so a noisy machine slows both alike; the ratio is
what to read. Also records the largest
difference between the two (float32 rounding: the kernel sums in another order).

One layer's weight stays in the caches from call to call, which a real step never sees: a
step streams all 538 MB of SmolLM2's weights from memory. So a second part, ``model``, runs
every linear layer of the model once, in order (30 x q, k, v, o, gate, up, down, then
``lm_head``), on separate weights, and times the whole sweep, torch and kernel alternating;
that is where the kernel's prefetch of the next weight panel shows.

``--threads N`` runs the kernel on N threads of batchgen's pool (torch on N threads too);
``--dtype bfloat16`` packs bfloat16 weights and feeds bfloat16 input (torch runs its own
bfloat16 GEMM). ``ceiling_gflops`` is the kernel's best rate over the single-layer shapes (one
weight hot in the caches: the compute ceiling); the whole-model sweep's rate at a row count is
the ceiling for a step of that many rows, whose weights stream from memory.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

NUM_LAYERS = 30
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = {  # name: (out_features, in_features)
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate_proj/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def best_times(fns: dict, reps: int, block_seconds: float = 0.2) -> dict[str, float]:
    """Fastest per-call time of each function over ``reps`` blocks, the functions' blocks
    interleaved; a block calls its function back to back for at least ``block_seconds`` (and at
    least 3 times) and counts the mean.

    Long blocks rather than single calls: torch's OpenMP workers keep spinning for tens of
    milliseconds after its last parallel call, and a kernel call timed in that window shares the
    cores with them, which a model step never sees (with the C kernels on, torch runs one
    thread). Timed call by call (or in 20 ms blocks), the kernel's q/o layer at 32 rows in
    float32 read 100-130 GFLOP/s; in 200 ms blocks 167-171, and 174 with no torch call at all.
    """
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            fn()
            calls, t0 = 0, time.perf_counter()
            while calls < 3 or time.perf_counter() - t0 < block_seconds:
                fn()
                calls += 1
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    from batchgen.kernels.cpu.linear import PackedLinear, unsupported_reason

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,128,1813")
    ap.add_argument("--model-rows", default="1,8,32,128", help="row counts for the whole-model sweep")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from batchgen.kernels.cpu import c_build

    torch.set_num_threads(args.threads)
    c_build.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    why = unsupported_reason(dtype, torch.device("cpu"))
    if why is not None:
        raise SystemExit(f"the CPU linear kernel cannot run here: {why}")
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    result: dict = {"threads": args.threads, "dtype": args.dtype, "rows": rows_list, "results": []}
    if dtype == torch.bfloat16:
        from batchgen.kernels.cpu.linear import bf16_path

        result["bf16_path"] = bf16_path()
    for name, (n, k) in SHAPES.items():
        layer = torch.nn.Linear(k, n, bias=False).to(dtype)
        packed = PackedLinear(layer)
        weight = layer.weight.detach()
        for m in rows_list:
            if name == "lm_head" and m > 128:
                continue  # the engine keeps only the sampled rows' logits
            x = torch.randn(m, k).to(dtype)
            with torch.no_grad():
                reps = 5
                best = best_times({"torch": lambda: F.linear(x, weight), "cpu": lambda: packed(x)}, reps)
                diff = (packed(x).float() - F.linear(x, weight).float()).abs().max().item()
            flop = 2 * m * n * k
            row = {"layer": name, "rows": m, "torch_ms": best["torch"] * 1e3, "cpu_ms": best["cpu"] * 1e3,
                   "torch_gflops": flop / best["torch"] / 1e9, "cpu_gflops": flop / best["cpu"] / 1e9,
                   "speedup": best["torch"] / best["cpu"], "max_abs_diff": diff}
            result["results"].append(row)
            print(f"{name:18s} rows {m:5d}: torch {row['torch_ms']:8.3f} ms ({row['torch_gflops']:5.1f} GFLOP/s)"
                  f"  cpu {row['cpu_ms']:8.3f} ms ({row['cpu_gflops']:5.1f})  {row['speedup']:.2f}x", flush=True)
    result["ceiling_gflops"] = max(r["cpu_gflops"] for r in result["results"])
    result["model"] = model_sweep([int(r) for r in args.model_rows.split(",")], dtype=dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def model_sweep(rows_list: list[int], repeats: int = 5, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Every linear layer of SmolLM2 once, in order, torch against the kernel (see the module
    docstring); the fastest of ``repeats`` sweeps each, the two alternating."""
    from batchgen.kernels.cpu.linear import PackedLinear

    shapes = LAYER_SHAPES * NUM_LAYERS + [SHAPES["lm_head"]]
    weights, packed = [], []
    for n, k in shapes:  # one at a time, so the unpacked and packed sets never coexist unfreed
        layer = torch.nn.Linear(k, n, bias=False).to(dtype)
        weights.append(layer.weight.detach())
        packed.append(PackedLinear(layer))
    rows_out = []
    for m in rows_list:
        inputs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}

        def sweep_torch() -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def sweep_cpu() -> None:
            for layer in packed:
                layer(inputs[layer.in_features])
        with torch.no_grad():
            best = best_times({"torch": sweep_torch, "cpu": sweep_cpu}, repeats, block_seconds=0.0)
        flop = 2 * m * sum(n * k for n, k in shapes)
        row = {"rows": m, "layers": len(shapes), "torch_ms": best["torch"] * 1e3, "cpu_ms": best["cpu"] * 1e3,
               "torch_gflops": flop / best["torch"] / 1e9, "cpu_gflops": flop / best["cpu"] / 1e9,
               "speedup": best["torch"] / best["cpu"]}
        rows_out.append(row)
        print(f"whole model rows {m:4d}: torch {row['torch_ms']:8.1f} ms ({row['torch_gflops']:5.1f} GFLOP/s)"
              f"  cpu {row['cpu_ms']:8.1f} ms ({row['cpu_gflops']:5.1f})  {row['speedup']:.2f}x", flush=True)
    return rows_out


if __name__ == "__main__":
    main()
