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


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _params_for(mode: str, max_tokens: int) -> Any:
    from batchgen import BeamSearchParams, SamplingParams

    if mode == "beam4":
        return BeamSearchParams(beam_width=4, max_tokens=max_tokens)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _watch(llm: Any, keep_program: bool) -> tuple[dict[str, float], list[dict[str, Any]], Any]:
    """Wrap ``llm``'s parts in timers (pass 1): the clock of the step in flight, the list each
    step's record is appended to, and the decoder program (None when the model has none)."""
    from batchgen.engine import core

    clock: dict[str, float] = defaultdict(float)
    lean = llm.runner.model.model.forward
    program = getattr(lean, "program", None)
    if program is not None and not keep_program:
        lean.program = None
    elif program is not None:
        wrap(program, "run", clock, "decoder_program")
    llm.runner.ops = TimedOps(llm.runner.ops, clock)
    time_linears(llm.runner.model, clock)
    for obj, attr, key in ((llm.scheduler, "schedule", "schedule"), (llm.runner, "prepare", "prepare"),
                           (llm.runner, "copy_blocks", "copy_blocks"), (llm.runner, "_forward", "forward"),
                           (llm.engine, "sampler", "sampling"),  # the Sampler instance the engine core calls
                           (core, "beam_step", "sampling")):  # beam search's top-k, forks and frees
        wrap(obj, attr, clock, key)
    steps: list[dict[str, Any]] = []
    inner_step, inner_schedule = llm.step, llm.scheduler.schedule
    last_plan: dict[str, Any] = {}

    def schedule_spy() -> Any:
        plan = inner_schedule()
        last_plan["decode"] = bool(plan.scheduled) and all(n == 1 for _, n in plan.scheduled)
        last_plan["seqs"] = len(plan.scheduled)
        return plan

    def step() -> Any:
        clock.clear()
        t0 = time.perf_counter()
        result = inner_step()
        rec: dict[str, Any] = dict(clock)
        rec.update(total=time.perf_counter() - t0, decode=last_plan.get("decode", False),
                   seqs=last_plan.get("seqs", 0))
        steps.append(rec)
        return result
    llm.scheduler.schedule = schedule_spy
    llm.step = step
    return clock, steps, program


TIMER_KEYS = ["schedule", "prepare", "copy_blocks", "attention", "linear", "decoder_program", "model_other",
              "sampling", "python_other"]


def _step_parts(s: dict[str, Any]) -> dict[str, float]:
    """One decode step's record split into TIMER_KEYS (model_other and python_other by difference)."""
    parts = {k: s.get(k, 0.0) for k in ("schedule", "prepare", "copy_blocks", "attention", "linear",
                                        "decoder_program")}
    parts["model_other"] = s.get("forward", 0.0) - parts["attention"] - parts["linear"] - parts["decoder_program"]
    parts["sampling"] = s.get("sampling", 0.0)
    parts["python_other"] = s["total"] - sum(parts.values())
    return parts


def _whole_run(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The whole run, split by step kind: steps that only decode, and steps holding a prefill."""
    whole: dict[str, dict[str, float]] = {}
    for kind, chosen in (("decode_steps", [s for s in steps if s["decode"]]),
                         ("prefill_steps", [s for s in steps if not s["decode"]])):
        whole[kind] = {"steps": len(chosen), **{k: sum(s.get(k, 0.0) for s in chosen)
                                                for k in ("total", "forward", "linear", "attention", "sampling")}}
    return whole


def _profiled_shares(llm: Any, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, dict]:
    """Pass 2: torch.profiler over a few decode steps of a fresh run on ``llm`` (an identical
    engine): self CPU time by category, and by op."""
    llm.runner.ops = TimedOps(llm.runner.ops, defaultdict(float))
    time_linears(llm.runner.model, defaultdict(float))
    inner = llm.step
    count = {"n": 0}
    events: list[Any] = []

    def step() -> Any:
        count["n"] += 1
        if 3 <= count["n"] < 3 + args.profiled_steps:  # step 1 is the prefill, then decodes
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                r = inner()
            events.extend(prof.events())
            return r
        return inner()
    llm.step = step
    llm.generate(prompts, _params_for(args.mode, 3 + args.profiled_steps))
    by_cat: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name == LINEAR_RANGE:  # the range's own time: a C GEMM (or the wrapper's overhead)
            top["linear layers outside aten"] += e.self_cpu_time_total
            by_cat["matmuls (linear layers, lm_head)"] += e.self_cpu_time_total
        elif e.name.startswith("aten::"):
            top[e.name] += e.self_cpu_time_total
            by_cat[_category(e)] += e.self_cpu_time_total
    return by_cat, top


def _category(event: Any) -> str:
    """An aten op's category by the ranges around it."""
    ranges = set()
    p = event.cpu_parent
    while p is not None:
        ranges.add(p.name)
        p = p.cpu_parent
    if ATTENTION_RANGE in ranges:
        return "attention ops"
    if event.name in MATMUL_OPS or LINEAR_RANGE in ranges:
        return "matmuls (linear layers, lm_head)"
    return "other model ops (norms, RoPE, activations, copies)"


NOTES = ("timers: medians over decode steps with at least half the prompts running; "
         "linear = the model's linear layers incl. lm_head (only lm_head with the decoder program kept); "
         "decoder_program = the C call that runs every decoder layer of a decode step; "
         "model_other = forward minus attention ops, linear layers and the program; python_other = step minus all "
         "timed parts. Profiler shares are self CPU time of aten ops and of the linear-layer ranges (profiler "
         "overhead included).")


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    engine: dict[str, Any] = dict(dtype=args.dtype, block_size=16, kv_cache_memory=2**30, max_num_seqs=256,
                                  max_num_batched_tokens=2048, num_threads=args.threads)
    if args.quantization:
        engine["quantization"] = args.quantization
    from batchgen import LLM
    from bench.workload import w32_prompts

    llm = LLM(args.model, **engine)
    # another model's vocabulary may be smaller than SmolLM2's: W32's ids wrap into it
    prompts = [[t % llm.runner.vocab_size for t in p] for p in w32_prompts()[: args.num_prompts]]
    _, steps, program = _watch(llm, args.decoder_program)
    llm.generate([list(range(1000, 1024))], _params_for(args.mode, 4))
    steps.clear()
    llm.generate(prompts, _params_for(args.mode, args.max_tokens))
    decode = [s for s in steps if s["decode"] and s["seqs"] >= max(1, len(prompts) // 2)]
    per_step = [_step_parts(s) for s in decode]
    timers = {k: statistics.median(p[k] for p in per_step) for k in TIMER_KEYS} if per_step else {}
    # The linear layers' rate in a decode step: 2 x rows x (in x out) summed over the layers
    # (every row reaches lm_head in a decode step), over the layers' measured time.
    weights = linear_weights(llm.runner.model)
    gflops = [2 * s["seqs"] * weights / s["linear"] / 1e9 for s in decode
              if s.get("linear") and not s.get("decoder_program")]  # the program's layers are not timed apart
    total_med = statistics.median(s["total"] for s in decode) if decode else 0.0
    by_cat, top = _profiled_shares(LLM(args.model, **engine), prompts, args)
    prof_total = sum(by_cat.values())
    result = {
        "workload": f"W32 ({len(prompts)} prompts) {'beam width 4' if args.mode == 'beam4' else 'greedy'}, "
                    f"max_tokens {args.max_tokens}",
        "mode": args.mode, "attention_backend": llm.runner.attention_backend,
        "linear_backend": llm.runner.linear_backend, "threads": args.threads, "dtype": args.dtype,
        "model": args.model, "quantization": llm.runner.source.quantization, "decode_steps_timed": len(decode),
        "decode_rows_median": statistics.median(s["seqs"] for s in decode) if decode else 0,
        "linear_weights": weights, "linear_gflops_median": statistics.median(gflops) if gflops else None,
        "whole_run_seconds": _whole_run(steps), "step_seconds_median": total_med, "timers_median_seconds": timers,
        "timers_share": {k: v / total_med for k, v in timers.items()} if total_med else {},
        "profiler_steps": args.profiled_steps,
        "profiler_self_cpu_share": {k: v / prof_total for k, v in by_cat.items()} if prof_total else {},
        "profiler_top_ops_ms": dict(sorted(((k, v / 1000) for k, v in top.items()), key=lambda kv: -kv[1])[:15]),
        "decoder_program": "kept, timed whole" if program is not None and args.decoder_program
        else ("set aside" if program is not None else "none for this model"),
        "notes": NOTES,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"linear layers {result['linear_gflops_median'] or 0:.1f} GFLOP/s; "
          f"decode step median {total_med * 1000:.0f} ms: " +
          ", ".join(f"{k} {v * 100:.0f}%" for k, v in result["timers_share"].items()))


if __name__ == "__main__":
    main()
