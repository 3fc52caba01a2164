"""Where a batchgen decode step spends its time: ``python -m bench.profile_step --out FILE``.

The decoder program (a decode step's layers in one C call) is set aside unless
``--decoder-program`` keeps it, timed whole. ``--mode greedy`` (default) or ``--mode beam4`` (beam width 4: 4 sequences per prompt, so a
decode step runs 4× the rows). Two passes over W32, both observing the engine from outside (instance attributes are
wrapped; no engine code changes):

1. *Timers* (no profiler overhead; also summed over the whole run, split into steps that only
   decode and steps that hold a prefill chunk): every step is split into scheduling
   (``scheduler.schedule``), input packing (``runner.prepare``), the model forward
   (``runner._forward``) and, inside it, the paged-attention ops (the ``ops`` object the runner
   hands to the attention function is replaced by a timing proxy) and the linear layers (each
   layer's ``forward`` is wrapped, whether torch's or batchgen's CPU GEMM), then sampling
   (``sampler``) and the rest of the step (Python bookkeeping: appends, stop checks,
   detokenising, block accounting). Only decode steps (every scheduled sequence adds one
   token) are aggregated.
2. *torch.profiler* over a few decode steps splits the forward into matmuls (``aten::mm``,
   ``addmm``, ``bmm``, ``matmul``, ``linear`` outside attention, and the time inside the
   linear layers' ranges), attention and other ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}
ATTENTION_RANGE = "bench::paged_attention"
LINEAR_RANGE = "bench::linear"


class TimedOps:
    """Proxy for the attention backend's ops: times each call (and marks a profiler range)."""

    def __init__(self, ops: Any, clock: dict[str, float]) -> None:
        self._ops = ops
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            with torch.profiler.record_function(ATTENTION_RANGE):
                out = fn(*args, **kwargs)
            self._clock["attention"] += time.perf_counter() - t0
            return out
        return timed


def _is_linear(module: torch.nn.Module) -> bool:
    """``nn.Linear``, or batchgen's ``PackedLinear`` or ``QuantizedLinear`` (GGUF blocks)."""
    from batchgen.kernels.cpu.linear import PackedLinear
    from batchgen.kernels.cpu.quant import QuantizedLinear

    return type(module) is torch.nn.Linear or isinstance(module, (PackedLinear, QuantizedLinear))


def time_linears(model: torch.nn.Module, clock: dict[str, float]) -> None:
    """Time every linear layer (:func:`_is_linear`) into ``clock["linear"]``, inside a profiler
    range: a C kernel called through ctypes is no aten op, so the profiler sees it only through
    the range."""
    for module in model.modules():
        if _is_linear(module):
            inner = module.forward

            def timed(x: torch.Tensor, inner: Callable = inner) -> torch.Tensor:
                t0 = time.perf_counter()
                with torch.profiler.record_function(LINEAR_RANGE):
                    out = inner(x)
                clock["linear"] += time.perf_counter() - t0
                return out
            module.forward = timed


def linear_weights(model: torch.nn.Module) -> int:
    """``in x out`` summed over the model's linear layers (those :func:`time_linears` times)."""
    return sum(m.in_features * m.out_features for m in model.modules() if _is_linear(m))


def wrap(obj: Any, attr: str, clock: dict[str, float], key: str) -> None:
    inner: Callable = getattr(obj, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - t0
    setattr(obj, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profiled-steps", type=int, default=3)
    ap.add_argument("--mode", choices=["greedy", "beam4"], default="greedy")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name or a .gguf path")
    ap.add_argument("--quantization", default=None, choices=["auto", "gguf", "none"],
                    help="the engine's quantization (default: its own, auto); gguf: the weights kept in their "
                         "GGUF blocks, linear layers then counted in int8 GOP/s")
    ap.add_argument("--decoder-program", action="store_true",
                    help="keep the decoder program (a decode step's layers in one C call), timed whole as "
                         "decoder_program; by default it is set aside, so that the layers' parts can be timed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = dict(dtype=args.dtype, block_size=16, kv_cache_memory=2**30, max_num_seqs=256,
                  max_num_batched_tokens=2048, num_threads=args.threads)
    if args.quantization:
        engine["quantization"] = args.quantization
    from batchgen import LLM, BeamSearchParams, SamplingParams
    from bench.workload import w32_prompts

    def params_for(max_tokens: int) -> SamplingParams | BeamSearchParams:
        if args.mode == "beam4":
            return BeamSearchParams(beam_width=4, max_tokens=max_tokens)
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)

    prompts = w32_prompts()[: args.num_prompts]
    llm = LLM(args.model, **engine)
    # another model's vocabulary may be smaller than SmolLM2's: W32's ids wrap into it
    prompts = [[t % llm.runner.vocab_size for t in p] for p in prompts]
    clock: dict[str, float] = defaultdict(float)
    lean = llm.runner.model.model.forward
    program = getattr(lean, "program", None)
    if program is not None and not args.decoder_program:
        lean.program = None
    elif program is not None:
        wrap(program, "run", clock, "decoder_program")
    llm.runner.ops = TimedOps(llm.runner.ops, clock)
    time_linears(llm.runner.model, clock)
    wrap(llm.scheduler, "schedule", clock, "schedule")
    wrap(llm.runner, "prepare", clock, "prepare")
    wrap(llm.runner, "copy_blocks", clock, "copy_blocks")
    wrap(llm.runner, "_forward", clock, "forward")
    wrap(llm.engine, "sampler", clock, "sampling")  # the Sampler instance the engine core calls
    from batchgen.engine import core

    wrap(core, "beam_step", clock, "sampling")  # beam search's top-k, forks and frees

    steps: list[dict[str, float]] = []
    inner_step = llm.step
    inner_schedule = llm.scheduler.schedule
    last_plan: dict[str, Any] = {}

    def schedule_spy() -> Any:
        plan = inner_schedule()
        last_plan["decode"] = bool(plan.scheduled) and all(n == 1 for _, n in plan.scheduled)
        last_plan["seqs"] = len(plan.scheduled)
        return plan
    llm.scheduler.schedule = schedule_spy

    profile_state = {"left": 0, "prof": None}

    def step() -> Any:
        clock.clear()
        t0 = time.perf_counter()
        result = inner_step()
        total = time.perf_counter() - t0
        rec = dict(clock)
        rec["total"] = total
        rec["decode"] = last_plan.get("decode", False)
        rec["seqs"] = last_plan.get("seqs", 0)
        steps.append(rec)
        return result
    llm.step = step
    params = params_for(args.max_tokens)
    llm.generate([list(range(1000, 1024))], params_for(4))
    steps.clear()
    llm.generate(prompts, params)

    decode = [s for s in steps if s["decode"] and s["seqs"] >= max(1, len(prompts) // 2)]
    # The whole run, split by step kind: steps that only decode, and steps holding a prefill.
    whole: dict[str, dict[str, float]] = {}
    for kind, chosen in (("decode_steps", [s for s in steps if s["decode"]]),
                         ("prefill_steps", [s for s in steps if not s["decode"]])):
        whole[kind] = {"steps": len(chosen), **{k: sum(s.get(k, 0.0) for s in chosen)
                                                for k in ("total", "forward", "linear", "attention", "sampling")}}
    keys = ["schedule", "prepare", "copy_blocks", "attention", "linear", "decoder_program", "model_other",
            "sampling", "python_other"]
    per_step: dict[str, list[float]] = {k: [] for k in keys}
    totals = []
    for s in decode:
        fwd = s.get("forward", 0.0)
        att = s.get("attention", 0.0)
        lin = s.get("linear", 0.0)
        prog = s.get("decoder_program", 0.0)
        parts = {"schedule": s.get("schedule", 0.0), "prepare": s.get("prepare", 0.0),
                 "copy_blocks": s.get("copy_blocks", 0.0), "attention": att, "linear": lin,
                 "decoder_program": prog, "model_other": fwd - att - lin - prog, "sampling": s.get("sampling", 0.0)}
        parts["python_other"] = s["total"] - sum(parts.values())
        for k in keys:
            per_step[k].append(parts[k])
        totals.append(s["total"])
    timers = {k: statistics.median(v) for k, v in per_step.items() if v}
    # The linear layers' rate in a decode step: 2 x rows x (in x out) summed over the layers
    # (every row reaches lm_head in a decode step), over the layers' measured time.
    weights = linear_weights(llm.runner.model)
    gflops = [2 * s["seqs"] * weights / s["linear"] / 1e9 for s in decode
              if s.get("linear") and not s.get("decoder_program")]  # the program's layers are not timed apart
    total_med = statistics.median(totals) if totals else 0.0

    # Pass 2: torch.profiler over a few decode steps of a fresh, identical run.
    llm2 = LLM(args.model, **engine)
    llm2.runner.ops = TimedOps(llm2.runner.ops, defaultdict(float))
    time_linears(llm2.runner.model, defaultdict(float))
    inner2 = llm2.step
    count = {"n": 0}
    events: list[Any] = []

    def step2() -> Any:
        count["n"] += 1
        if 3 <= count["n"] < 3 + args.profiled_steps:  # step 1 is the prefill, then decodes
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                r = inner2()
            events.extend(prof.events())
            return r
        return inner2()
    llm2.step = step2
    llm2.generate(prompts, params_for(3 + args.profiled_steps))
    by_cat: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in events:
        self_us = e.self_cpu_time_total
        if e.name == LINEAR_RANGE:  # the range's own time: a C GEMM (or the wrapper's overhead)
            top["linear layers outside aten"] += self_us
            by_cat["matmuls (linear layers, lm_head)"] += self_us
            continue
        if not e.name.startswith("aten::"):
            continue
        ranges = set()
        p = e.cpu_parent
        while p is not None:
            ranges.add(p.name)
            p = p.cpu_parent
        top[e.name] += self_us
        if ATTENTION_RANGE in ranges:
            by_cat["attention ops"] += self_us
        elif e.name in MATMUL_OPS or LINEAR_RANGE in ranges:
            by_cat["matmuls (linear layers, lm_head)"] += self_us
        else:
            by_cat["other model ops (norms, RoPE, activations, copies)"] += self_us
    prof_total = sum(by_cat.values())
    result = {
        "workload": f"W32 ({len(prompts)} prompts) {'beam width 4' if args.mode == 'beam4' else 'greedy'}, "
                    f"max_tokens {args.max_tokens}",
        "mode": args.mode,
        "attention_backend": llm.runner.attention_backend,
        "linear_backend": llm.runner.linear_backend,
        "threads": args.threads,
        "dtype": args.dtype,
        "model": args.model,
        "quantization": llm.runner.source.quantization,
        "decode_steps_timed": len(decode),
        "decode_rows_median": statistics.median(s["seqs"] for s in decode) if decode else 0,
        "linear_weights": weights,
        "linear_gflops_median": statistics.median(gflops) if gflops else None,
        "whole_run_seconds": whole,
        "step_seconds_median": total_med,
        "timers_median_seconds": timers,
        "timers_share": {k: v / total_med for k, v in timers.items()} if total_med else {},
        "profiler_steps": args.profiled_steps,
        "profiler_self_cpu_share": {k: v / prof_total for k, v in by_cat.items()} if prof_total else {},
        "profiler_top_ops_ms": dict(sorted(((k, v / 1000) for k, v in top.items()), key=lambda kv: -kv[1])[:15]),
        "decoder_program": "kept, timed whole" if program is not None and args.decoder_program
        else ("set aside" if program is not None else "none for this model"),
        "notes": "timers: medians over decode steps with at least half the prompts running; "
                 "linear = the model's linear layers incl. lm_head (only lm_head with the decoder program kept); "
                 "decoder_program = the C call that runs every decoder layer of a decode step; "
                 "model_other = forward minus attention ops, linear layers and the program; python_other = step minus all timed parts. "
                 "Profiler shares are self CPU time of aten ops and of the linear-layer ranges (profiler overhead included).",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"linear layers {result['linear_gflops_median'] or 0:.1f} GFLOP/s; "
          f"decode step median {total_med * 1000:.0f} ms: " +
          ", ".join(f"{k} {v * 100:.0f}%" for k, v in result["timers_share"].items()))


if __name__ == "__main__":
    main()
