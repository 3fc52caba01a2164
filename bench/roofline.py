"""The roofline: how far each workload is from what this machine can do (``python -m bench --parts roof``).

Measured on the machine itself, in one process (bench/README.md, "The roofline"):

* **read bandwidth** at 1 and 2 threads: ``bench/roof_read.c`` reads a 1 GiB buffer (32 times
  this CPU's L3) with full-width loads, one C call per thread on its own slice; best of N;
* **ceilings**: the int8 and float32 tight loops of ``bench/quant_peak.c``
  (:func:`bench.quant_kernel.peaks`), and the float32 linear kernel on one hot layer;
* **workloads** at 2 threads, every engine step observed from outside (``llm.step`` and the
  scheduler's ``schedule`` wrapped on the instance): the random 1B Llama of ``bench.gguf_rows``
  in Q4_K and Q8_0 (GGUF-native) decoding at each ``--batches`` (random 32-token prompts, EOS
  ignored) and one 512-token prefill step; SmolLM2 on W32, GGUF-native (Q4_1) and float32, and
  one 2,048-token rolling-perplexity window of each (:mod:`bench.roof_scoring`: its roof adds
  attention's float32 work to the linear layers').

Per step (:func:`bench.roof_math.roof_fields`): the linear layers' weight bytes (each tensor as
the GGUF file stores it; 4 bytes a value in float32) and operations (2 x rows x in x out; a prefill's lm_head
on each prompt's last position only) over its time give GB/s against the read bandwidth and
GOP/s against the ceiling; the roof at its intensity (ops / weight bytes) is ``min(ceiling,
intensity x bandwidth)`` and ``of_roof`` the fraction reached. Attention's KV reads are left
out of the intensity (``kv_bytes_per_step`` is beside it). Step times are the fastest step,
the roof's figures best-of too (medians in the JSON): the machine may be shared, so the JSON
records the load average and CPU shares.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.roof_math import (Weight, as_float32, attention_flops, causal_keys, gguf_weights, roof_fields, step_bytes,
                             step_ops, step_roof_fields)
from bench.roof_scoring import rolling_row

HERE = Path(__file__).resolve().parent
GIB = 2**30
MIB = 2**20
PREFILL_TOKENS = 512
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16")
# ---------------------------------------------------------------- the machine's roof
def read_bandwidth(threads_list: list[int], buffer_bytes: int = GIB, repeats: int = 5) -> dict:
    """GB/s of the best of ``repeats`` reads of the whole buffer, per thread count (module docstring)."""
    from batchgen.kernels.cpu import c_build

    lib, _ = c_build.build("the read-bandwidth loop", HERE / "roof_read.c", [])
    flags = c_build.cpu_flags() or frozenset()
    sym = "roof_read512" if "avx512f" in flags else "roof_read256"
    fn = getattr(lib, sym)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    buf = np.ones(buffer_bytes // 4, dtype=np.float32)  # written, so every page is mapped
    out: dict = {"kernel": sym, "buffer_bytes": buf.nbytes, "repeats": repeats}
    for t in threads_list:
        per = (buf.size // t) // 128 * 128
        ptrs = [buf.ctypes.data + i * per * 4 for i in range(t)]
        fn(ptrs[0], per, 1)
        times, c0, w0 = [], time.process_time(), time.perf_counter()
        for _ in range(repeats):
            ths = [threading.Thread(target=fn, args=(p, per, 1)) for p in ptrs]
            t0 = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            times.append(time.perf_counter() - t0)
        out[f"{t}t_gbs"] = per * 4 * t / min(times) / 1e9
        out[f"{t}t_median_gbs"] = per * 4 * t / statistics.median(times) / 1e9
        out[f"{t}t_cpu_share"] = (time.process_time() - c0) / ((time.perf_counter() - w0) * t)
    return out


def best_peak(peaks: dict, kind: str, threads: int) -> float | None:
    """The fastest ``kind`` (``int8`` or ``fp32``) loop of ``peaks`` at ``threads`` threads."""
    return max((v for k, v in peaks.items() if k.startswith(kind) and k.endswith(f"_{threads}t") and v), default=None)


def ceilings(threads_list: list[int], seconds: float) -> dict:
    """The tight-loop peaks (GOP/s) and the float32 kernel's best hot layer (GFLOP/s)."""
    import torch

    from batchgen.kernels.cpu import c_build
    from batchgen.kernels.cpu.linear import PackedLinear
    from bench.linear_kernel import best_times
    from bench.quant_kernel import peaks

    c0, t0 = time.process_time(), time.perf_counter()
    out = {"peaks": peaks(threads_list, seconds)}
    # CPU time over wall time x threads, 1 + 2 threads' runs weighted alike: 1.0 on a quiet machine
    out["cpu_share"] = (time.process_time() - c0) / ((time.perf_counter() - t0) * sum(threads_list) / len(threads_list))
    c_build.set_num_threads(max(threads_list))
    layer = PackedLinear(torch.nn.Linear(576, 1536, bias=False))
    x = torch.randn(128, 576)
    with torch.no_grad():
        best = best_times({"cpu": lambda: layer(x)}, 3, block_seconds=seconds)["cpu"]
    out["fp32_kernel_layer_gflops"] = 2 * 128 * 1536 * 576 / best / 1e9
    t, p = max(threads_list), out["peaks"]
    out["int8"], out["fp32"] = best_peak(p, "int8", t), best_peak(p, "fp32", t)
    return out


# ---------------------------------------------------------------- the workloads
def observe_steps(llm: Any) -> list[dict]:
    """Wrap ``llm.step`` (and the scheduler's ``schedule``) on the instance; the returned list
    gets one record per step: seconds, sequences scheduled, tokens, and whether all decode."""
    steps: list[dict] = []
    inner_step, inner_schedule = llm.step, llm.scheduler.schedule
    plan_of: dict = {}

    def schedule() -> Any:
        plan = inner_schedule()
        plan_of["seqs"] = len(plan.scheduled)
        plan_of["tokens"] = sum(n for _, n in plan.scheduled)
        plan_of["decode"] = bool(plan.scheduled) and all(n == 1 for _, n in plan.scheduled)
        return plan

    def step() -> Any:
        plan_of.clear()
        t0 = time.perf_counter()
        result = inner_step()
        steps.append({"seconds": time.perf_counter() - t0, **plan_of})
        return result
    llm.scheduler.schedule, llm.step = schedule, step
    return steps


def random_prompts(n: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(n, length)).tolist()


def prefill_prompts(tokens: int, max_model_len: int) -> int:
    """How many prompts of equal length make one prefill step of ``tokens``: one, unless the
    model's context cannot hold that prompt and its one generated token (the random 1B's GGUF
    says 512: two of 256 then; the lm_head runs on each prompt's last position)."""
    n = 1
    while tokens % n or tokens // n + 1 > max_model_len:
        n += 1
    return n


def timed_row(kind: str, chosen: list[dict], ops: int, nbytes: int, kv: float, attn: float, roof: dict,
              ceiling: str) -> dict:
    """A workload row from its observed steps (the fastest is the figure): against the roof of
    its linear layers, and of the whole step with attention's ``kv`` bytes and ``attn`` FLOPs."""
    if not chosen:
        return {"kind": kind, "error": "no step of this kind was observed"}
    secs = [s["seconds"] for s in chosen]
    row = {"kind": kind, "steps": len(secs), "step_s": min(secs), "step_median_s": statistics.median(secs),
           "ops_per_step": ops, "weight_bytes_per_step": nbytes, "kv_bytes_per_step": kv, "ceiling": ceiling,
           "roof": roof}
    row.update(roof_fields(ops, nbytes, min(secs), roof["bandwidth_gbs"], roof[f"{ceiling}_gops"]))
    row["of_roof_median"] = roof_fields(ops, nbytes, row["step_median_s"], roof["bandwidth_gbs"],
                                        roof[f"{ceiling}_gops"])["of_roof"]
    row.update(step_roof_fields(ops, nbytes, kv, attn, min(secs), roof, ceiling), attention_flops=attn)
    return row


def model_rows(label: str, model: str, weights: list[Weight], roof: dict, *, quantization: str,
               batches: list[tuple[str, list[list[int]]]], max_tokens: int, prefill_repeats: int,
               log: Callable[[str], None], scoring: bool = False) -> list[dict]:
    """A decode row for each ``(name, prompts)`` of ``batches`` (all prompts at once) and, with
    ``prefill_repeats``, a row of 512-token prefill steps, on one engine; with ``scoring``, a
    rolling-perplexity window too (:mod:`bench.roof_scoring`)."""
    from batchgen import LLM, SamplingParams

    ceiling = "int8" if quantization == "gguf" else "fp32"
    llm = LLM(model, quantization=quantization, dtype="float32", num_threads=2, block_size=16,
              kv_cache_memory=768 * MIB, max_num_seqs=256, max_num_batched_tokens=2048)
    kv_token = llm.runner.kv_cache.num_bytes / (llm.runner.num_blocks * llm.config.block_size)
    vocab = llm.runner.vocab_size
    steps = observe_steps(llm)
    llm.generate([list(range(1000, 1024))], SamplingParams(temperature=0.0, max_tokens=4))
    rows = []
    for name, prompts in batches:
        batch = len(prompts)
        steps.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        share = (time.process_time() - c0) / (2 * (time.perf_counter() - t0))
        keys = sum(map(len, prompts)) + batch * max_tokens / 2  # the mean context a step reads
        chosen = [s for s in steps if s.get("decode") and s["seqs"] == batch]
        rows.append({"workload": label, "batch": batch, "cpu_share": share, **timed_row(
            f"decode {name}", chosen, step_ops(weights, batch), step_bytes(weights), kv_token * keys,
            attention_flops(llm.runner.model.config, keys), roof, ceiling)})
        log(f"  {label} decode {name}: {_brief(rows[-1])}")
    prefill, n = [], prefill_prompts(PREFILL_TOKENS, llm.max_model_len)
    c0, t0 = time.process_time(), time.perf_counter()
    for r in range(prefill_repeats):
        steps.clear()
        prompts = random_prompts(n, vocab, PREFILL_TOKENS // n, 1000 + r)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
        prefill += [s for s in steps if s.get("tokens") == PREFILL_TOKENS]
    if prefill_repeats:
        share = (time.process_time() - c0) / (2 * (time.perf_counter() - t0))
        rows.append({"workload": label, "batch": n, "cpu_share": share, **timed_row(
            f"prefill {PREFILL_TOKENS}", prefill, step_ops(weights, PREFILL_TOKENS, n), step_bytes(weights),
            kv_token * PREFILL_TOKENS / 2 / n, attention_flops(llm.runner.model.config, n * causal_keys(PREFILL_TOKENS // n)),
            roof, ceiling)})
        log(f"  {label} prefill {PREFILL_TOKENS}: {_brief(rows[-1])}")
    if scoring:
        rows.append({"workload": label, **rolling_row(llm, weights, roof, ceiling, max(prefill_repeats, 2))})
        log(f"  {label} {rows[-1]['kind']}: {_brief(rows[-1])}")
    return rows


def _brief(row: dict) -> str:
    if "error" in row:
        return row["error"]
    return (f"{row['step_s'] * 1e3:.1f} ms, {row['weight_gbs']:.1f} GB/s, {row['gops']:.0f} GOP/s, "
            f"{row['of_roof'] * 100:.0f} % of the roof ({row['bound']})")


# ---------------------------------------------------------------- the part, its table and plot
def roof_now(quick: bool) -> dict:
    """The roof at 2 threads, measured now: read bandwidth and the int8 / float32 ceilings."""
    import os

    bw, c = read_bandwidth([2], GIB, 3 if quick else 5), ceilings([2], 0.15 if quick else 0.3)
    return {"bandwidth_gbs": bw["2t_gbs"], "int8_gops": c["int8"], "fp32_gops": c["fp32"], "threads": 2,
            "loadavg": os.getloadavg(), "cpu_share": c["cpu_share"]}


def part(args: Any, out: Path, log: Callable[[str], None], machine: dict, save: Callable[..., None]) -> dict:
    """Measure the roof, then each workload under it, into ``roof.json`` and ``roof.png``."""
    import os

    from batchgen.kernels.cpu import c_build
    from bench import roof_report
    from bench.gguf_rows import embedded_gguf, one_b_model
    from bench.model_shapes import SHAPES
    from bench.quant_kernel import cpu_name
    from bench.workload import w32_prompts

    quick = bool(args.quick)
    flags = c_build.cpu_flags() or frozenset()
    result: dict = {"cpu": cpu_name(), "isa": sorted(f for f in flags if f in ISA_FLAGS), "cores": os.cpu_count(),
                    "quick": quick, "machine": machine, "loadavg_before": os.getloadavg(), "rows": []}
    log("roof: read bandwidth (1 GiB, 1 and 2 threads) and the ceilings")
    result["bandwidth"] = read_bandwidth([1, 2], GIB, 3 if quick else 5)
    result["ceilings"] = ceilings([1, 2], 0.15 if quick else 0.3)
    result["roof"] = {"bandwidth_gbs": result["bandwidth"]["2t_gbs"], "int8_gops": result["ceilings"]["int8"],
                      "fp32_gops": result["ceilings"]["fp32"], "threads": 2, "loadavg": os.getloadavg(),
                      "cpu_share": result["ceilings"]["cpu_share"]}
    result["reference"] = calm_reference()
    log(f"  roof: {result['roof']}")
    save("roof", result, out)
    max_tokens, prefill_repeats = (8, 2) if quick else (32, 3)
    result["decode_max_tokens"], result["prefill_repeats"] = max_tokens, prefill_repeats
    # each run: label, model, weights, quantization, decode batches, prefill repeats, and whether
    # it scores a rolling-perplexity window (SmolLM2: the scoring part's model)
    runs = [(f"1B {q}", str(one_b_model(q)), gguf_weights(one_b_model(q)), "gguf",
             [(f"b{b}", random_prompts(b, SHAPES["1b"].vocab, 32, b)) for b in args.batches], prefill_repeats, False)
            for q in ("Q4_K", "Q8_0")]
    smol = gguf_weights(embedded_gguf())
    w32 = [("W32 (b32)", w32_prompts())]
    runs += [("SmolLM2 Q4_1", "smollm2-135m-instruct", smol, "gguf", w32, prefill_repeats, True),
             ("SmolLM2 fp32", "smollm2-135m-instruct", as_float32(smol), "none", w32, prefill_repeats, True)]
    for label, model, weights, quantization, batches, repeats, scoring in runs:
        roof = roof_now(quick)  # the load drifts: each model's rows against the roof measured just before
        log(f"roof: {label}; roof now {roof['bandwidth_gbs']:.1f} GB/s, int8 {roof['int8_gops']:.0f}, "
            f"fp32 {roof['fp32_gops']:.0f} GOP/s")
        try:
            result["rows"] += model_rows(label, model, weights, roof, quantization=quantization,
                                         batches=batches, max_tokens=max_tokens, prefill_repeats=repeats, log=log,
                                         scoring=scoring)
        except Exception as exc:  # one workload's failure is recorded; the others still run
            result["rows"].append({"workload": label, "error": f"{type(exc).__name__}: {exc}"})
        save("roof", result, out)
    result["loadavg_after"] = os.getloadavg()
    result["roof_after"] = roof_now(quick)
    save("roof", result, out)
    roof_report.plot(result, out / "roof.png")
    return result


def calm_reference(path: Path = HERE / "results" / "quant_kernel_epyc.json") -> dict | None:
    """The same ceiling loops from the committed ``bench.quant_kernel`` run (a calmer machine),
    to show how much of the CPU a loaded run had."""
    import json

    if not path.is_file():
        return None
    k = json.loads(path.read_text())
    p = k.get("peaks", {})
    return {"source": f"bench/results/{path.name}", "loadavg_before": k.get("loadavg_before"),
            "int8_gops": best_peak(p, "int8", 2), "fp32_gops": best_peak(p, "fp32", 2)}
