"""The CPU linear kernel against torch's GEMM: ``python -m bench.linear_kernel --out FILE``.

For SmolLM2-135M's layer shapes (q/o 576->576, k/v 576->192, gate/up 576->1536, down
1536->576, lm_head 576->49152) and row counts from a lone decode to a prefill, times
``F.linear`` (MKL) and :class:`batchgen.kernels.cpu_linear.PackedLinear` on the same random
float32 weights and input. The two are interleaved call by call and each keeps its fastest
call, so a noisy machine slows both alike; the ratio is what to read. Also records the largest
difference between the two (float32 rounding: the kernel sums in another order).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out_features, in_features)
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate_proj/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def best_times(fns: dict, reps: int) -> dict[str, float]:
    """Fastest of ``reps`` calls of each function, the functions interleaved."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    from batchgen.kernels.cpu_linear import PackedLinear, unsupported_reason

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,128,1813")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    why = unsupported_reason(torch.float32, torch.device("cpu"))
    if why is not None:
        raise SystemExit(f"the CPU linear kernel cannot run here: {why}")
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    result: dict = {"threads": args.threads, "rows": rows_list, "results": []}
    for name, (n, k) in SHAPES.items():
        layer = torch.nn.Linear(k, n, bias=False)
        packed = PackedLinear(layer)
        weight = layer.weight.detach()
        for m in rows_list:
            if name == "lm_head" and m > 128:
                continue  # the engine keeps only the sampled rows' logits
            x = torch.randn(m, k)
            with torch.no_grad():
                reps = max(3, min(40, int(2e9 / (2 * m * n * k))))
                best = best_times({"torch": lambda: F.linear(x, weight), "cpu": lambda: packed(x)}, reps)
                diff = (packed(x) - F.linear(x, weight)).abs().max().item()
            flop = 2 * m * n * k
            row = {"layer": name, "rows": m, "torch_ms": best["torch"] * 1e3, "cpu_ms": best["cpu"] * 1e3,
                   "torch_gflops": flop / best["torch"] / 1e9, "cpu_gflops": flop / best["cpu"] / 1e9,
                   "speedup": best["torch"] / best["cpu"], "max_abs_diff": diff}
            result["results"].append(row)
            print(f"{name:18s} rows {m:5d}: torch {row['torch_ms']:8.3f} ms ({row['torch_gflops']:5.1f} GFLOP/s)"
                  f"  cpu {row['cpu_ms']:8.3f} ms ({row['cpu_gflops']:5.1f})  {row['speedup']:.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
