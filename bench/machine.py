"""The whole machine: every peer at every core, in float32 and bfloat16, and beside a busy loop.

``python -m bench --parts machine`` runs one workload (``--workload w32`` or ``w256``), the
modes of ``--modes``, one dtype (``--dtype float32`` or ``bfloat16``, given to every peer), with
``--threads`` threads per peer (default here: every CPU this process may use), peers interleaved
per repeat as in the throughput part:

* ``batchgen`` at its defaults (no ``OMP_NUM_THREADS``: ``num_threads: auto``, which is every CPU
  of the affinity mask, capped by a cgroup quota); ``batchgen_1t`` the same at one thread (with
  ``--one-thread``), for the check that the defaults are never slower than one thread;
* ``hf_generate`` (a static left-padded batch) with ``--threads`` torch threads;
* ``vllm_bs<B>``: vLLM's CPU build with block size B, one peer per size of
  ``--vllm-block-sizes`` (its default is 128 on CPU; ``best``: the fastest in the W32 greedy
  row of the same dtype), its OpenMP threads bound to cores 0..threads-1. A table row compares
  batchgen with the fastest of them.

Every peer gets the same KV budget (1 GiB). Sampling runs without a per-request seed (vLLM's CPU
build fails with one). Rows are keyed ``<workload>/<mode>/<dtype><--tag>`` in
``bench/results/machine.json``; a rerun of a key replaces it, other keys stay.

``--dtype all`` (and the GGUF file workloads, ``bench.model_shapes.WORKLOADS``) run the GGUF rows instead: see :mod:`bench.gguf_rows`.

``python -m bench --parts contention`` runs batchgen at its defaults on W32 greedy with nothing
else running, then beside one and two CPU-bound processes (``python -c 'while True: pass'``),
interleaved per repeat; ``contention.json`` has tokens/s of each and the quiet / busy ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import runner
from bench.workload import w32_prompts, w256_prompts

MIB = 2**20
GIB = 2**30
BUSY_LOOP = "while True: pass"


def default_threads() -> int:
    """The CPUs this process may use, as batchgen's ``num_threads: auto`` counts them."""
    from batchgen.threads import available_cpus

    return available_cpus()


def workload(name: str, num_prompts: int | None) -> list[list[int]]:
    """W32 or W256 (the first ``num_prompts`` of it when given)."""
    if name == "w32":
        prompts = w32_prompts()
    elif name == "w256":
        from transformers import AutoTokenizer

        from batchgen.model_resolver import resolve_model

        prompts = w256_prompts(AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path))
    else:
        raise ValueError(f"unknown workload {name!r}; choose w32 or w256")
    return prompts[:num_prompts] if num_prompts else prompts


def peers_for(args: Any, mode: dict, dtype: str, use_vllm: bool) -> dict[str, dict]:
    """The peers of one row (see the module docstring), filtered by ``--peers``."""
    peers: dict[str, dict] = {"batchgen": {"kv_cache_memory": GIB, "dtype": dtype, "threads": 0}}
    if args.one_thread:
        peers["batchgen_1t"] = {"as": "batchgen", "kv_cache_memory": GIB, "dtype": dtype, "threads": 1}
    peers["hf_generate"] = {"dtype": dtype}
    if use_vllm and mode["kind"] != "beam":  # vLLM's beam search: 2.8 tok/s at 1 thread (summary.md)
        for bs in args.vllm_block_sizes:
            if bs == "best":  # the fastest block size of this dtype's W32 greedy row
                bs = best_block_size(args.out_dir, dtype)
            peers[f"vllm_bs{bs}"] = {"as": "vllm", "kv_gib": 1, "dtype": dtype, "block_size": bs}
    return runner.select_peers(peers, args.peers)


def best_block_size(out: Path, dtype: str) -> int:
    """vLLM's fastest block size in the W32 greedy row of ``dtype`` in ``machine.json``.

    Raises:
        ValueError: no such row, or no vLLM peer finished in it.
    """
    path = out / "machine.json"
    row = json.loads(path.read_text())["rows"].get(f"w32/greedy/{dtype}") if path.is_file() else None
    best = best_vllm(row["peers"]) if row else None
    if best is None:
        raise ValueError(f"--vllm-block-sizes best needs a finished w32/greedy/{dtype} row with vLLM in {path}")
    return int(best.split("_bs")[1])


def best_vllm(res: dict) -> str | None:
    """The vLLM peer (block size) with the highest median tokens/s in this row."""
    names = [k for k, v in res.items() if k.startswith("vllm") and v.get("summary", {}).get("ok")]
    return max(names, key=lambda k: res[k]["summary"]["tokens_per_s_median"]) if names else None


def part(args: Any, out: Path, log: Callable[[str], None], machine: dict,
         vllm_status: Callable[[], tuple[bool, str]], modes: dict, strip: Callable[[dict], None],
         save: Callable[[str, dict, Path], None]) -> dict:
    """``--parts machine``: one workload and dtype, the modes of ``--modes`` (see above)."""
    path = out / "machine.json"
    result: dict = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    args.out_dir = out
    use_vllm, why = (False, "disabled with --no-vllm") if args.no_vllm else vllm_status()
    log(f"vLLM: {'available' if use_vllm else 'not run'}: {why}")
    threads = args.threads_given or default_threads()
    from bench import gguf_rows, model_shapes

    if args.dtype == "all" or args.workload in model_shapes.WORKLOADS:  # the GGUF rows: every dtype and llama.cpp

        gguf_rows.part(args, result, lambda name: workload(name, args.num_prompts if name == "w32"
                                                           else args.scaling_prompts),
                       log, machine, strip, lambda res: save("machine", res, out), threads)
        return result
    prompts = workload(args.workload, args.num_prompts if args.workload == "w32" else args.scaling_prompts)
    for mode_name in args.modes:
        mode = dict(modes[mode_name], request_seed=False) if modes[mode_name]["kind"] == "sample" else modes[mode_name]
        peers = peers_for(args, mode, args.dtype, use_vllm)
        reps = args.repeats_greedy if mode_name == "greedy" else args.repeats
        key = f"{args.workload}/{mode_name}/{args.dtype}{args.tag}"
        log(f"machine {key}: {len(prompts)} prompts, {threads} threads, {list(peers)} x {reps} repeats")
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        res = runner.interleaved(peers, prompts, mode, args.max_tokens, reps, args.log_dir, threads,
                                 run_timeout=args.run_timeout, on_event=log)
        greedy_same = None
        if mode["kind"] == "greedy" and res.get("batchgen", {}).get("runs"):
            ours = res["batchgen"]["runs"][0]["outputs"]
            greedy_same = {k: sum(a == b for a, b in zip(ours, v["runs"][0]["outputs"]))
                           for k, v in res.items() if k != "batchgen" and v.get("runs")}
        strip(res)
        best = best_vllm(res)
        result["rows"][key] = {
            "workload": args.workload, "num_prompts": len(prompts), "mode": mode, "dtype": args.dtype,
            "max_tokens": args.max_tokens, "threads": threads, "repeats": reps, "peers": res,
            "ratios": runner.ratios(res), "best_vllm": best,
            "identical_greedy_outputs_vs_batchgen": greedy_same,
            "vllm": {"available": use_vllm, "detail": why}, "machine": machine, "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        save("machine", result, out)
        for name, r in result["rows"][key]["ratios"].items():
            log(f"  batchgen / {name}: {r['of_medians']:.2f}x (paired {r['paired_all']})")
    return result


def contention(args: Any, out: Path, log: Callable[[str], None], machine: dict,
               save: Callable[[str, dict, Path], None]) -> dict:
    """``--parts contention``: batchgen at its defaults, quiet and beside 1 and 2 busy loops."""
    prompts = w32_prompts()[: args.num_prompts]
    mode = {"kind": "greedy"}
    conditions = [0, 1, 2]
    result: dict = {"workload": f"W32 ({len(prompts)} prompts), greedy", "max_tokens": args.max_tokens,
                    "dtype": args.dtype, "busy_loop": f"python -c '{BUSY_LOOP}'",
                    "machine": machine, "runs": []}
    w = runner.start_worker("batchgen", {"kv_cache_memory": GIB, "dtype": args.dtype, "threads": 0},
                            args.log_dir, 0)
    try:
        result["setup"] = w.wait_ready(900)
        log(f"contention: batchgen at its defaults ({result['setup'].get('num_threads')} threads), "
            f"{conditions} busy loops x {args.repeats_greedy} repeats")
        for r in range(args.repeats_greedy):
            order = conditions[r % 3:] + conditions[: r % 3]
            for busy in order:
                loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
                try:
                    time.sleep(0.5 if busy else 0)
                    res = w.run(prompts, mode, args.max_tokens, r, args.run_timeout)
                finally:
                    for p in loops:
                        p.kill()
                        p.wait()
                if "seconds" not in res:
                    raise runner.WorkerError(f"batchgen run failed: {res.get('error')}")
                row = {"repeat": r, "busy_loops": busy, "tokens": res["tokens"], "seconds": res["seconds"],
                       "tokens_per_s": res["tokens"] / res["seconds"]}
                result["runs"].append(row)
                log(f"  rep {r}, {busy} busy loops: {row['tokens_per_s']:.1f} tok/s")
    finally:
        w.close()
    by = {b: [x["tokens_per_s"] for x in result["runs"] if x["busy_loops"] == b] for b in conditions}
    quiet = {x["repeat"]: x["tokens_per_s"] for x in result["runs"] if x["busy_loops"] == 0}
    result["summary"] = {}
    for b in conditions:
        paired = [quiet[x["repeat"]] / x["tokens_per_s"] for x in result["runs"]
                  if x["busy_loops"] == b and x["repeat"] in quiet]
        result["summary"][str(b)] = {"tokens_per_s_median": statistics.median(by[b]),
                                     "tokens_per_s_min": min(by[b]), "tokens_per_s_max": max(by[b]),
                                     "slowdown_paired": paired,
                                     "slowdown_median": statistics.median(paired) if paired else None}
    save("contention", result, out)
    return result


def _row_order(key: str) -> tuple:
    """W32 before W256, greedy / n4 / beam4, float32 before bfloat16, tagged rows last."""
    order = {"w32": 0, "w256": 1, "greedy": 0, "n4": 1, "beam4": 2, "float32": 0, "bfloat16": 1}
    return [order.get(part, 9) for part in key.split("/")], key


def _color(name: str) -> str:
    return ("#1f5fa8" if name == "batchgen" else "#6a9fd4" if name.startswith("batchgen") else
            "#d4762a" if name.startswith("vllm") else "#888")


def plot(out: Path, keys: list[str] | None = None, name: str = "machine.png",
         color: Callable[[str], str] = _color) -> bool:
    """``machine.png``: tokens/s per peer for each of ``keys`` of ``machine.json`` (default: the
    plain rows, at 64 tokens), median and min-max, one panel a row; False when there is none."""
    path = out / "machine.json"
    if not path.is_file():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(path.read_text())["rows"]
    if keys is None:
        keys = [k for k in sorted(rows, key=_row_order) if rows[k]["max_tokens"] == 64 and rows[k]["dtype"] != "all"]
    if not keys:
        return False
    cols = min(4, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        peers = {k: v["summary"] for k, v in rows[key]["peers"].items() if v.get("summary", {}).get("ok")}
        names = list(peers)
        med = [peers[n]["tokens_per_s_median"] for n in names]
        err = [[m - peers[n]["tokens_per_s_min"] for n, m in zip(names, med)],
               [peers[n]["tokens_per_s_max"] - m for n, m in zip(names, med)]]
        ax.bar(range(len(names)), med, yerr=err, capsize=3, color=[color(n) for n in names])
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_title(f"{key}\n{rows[key]['num_prompts']} prompts x {rows[key]['max_tokens']}, "
                     f"{rows[key]['threads']} threads", fontsize=8)
    for row in axes:
        row[0].set_ylabel("generated tokens/s")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return True


def ceiling_rows(out: Path) -> list[dict]:
    """The decode step's linear layers against the GEMM ceiling, per dtype at 2 threads, from
    ``profile_2t_<dtype>.json`` and ``linear_kernel_2t_<dtype>.json``."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        prof, lk = out / f"profile_2t_{dtype}.json", out / f"linear_kernel_2t_{dtype}.json"
        if not (prof.is_file() and lk.is_file()):
            continue
        p, k = json.loads(prof.read_text()), json.loads(lk.read_text())
        step = p.get("linear_gflops_median")
        rows_m = p.get("decode_rows_median")
        sweep = min(k.get("model", []), key=lambda r: abs(r["rows"] - rows_m), default=None) if rows_m else None
        rows.append({"dtype": dtype, "decode_rows": rows_m, "step_linear_gflops": step,
                     "ceiling_gflops": k["ceiling_gflops"], "of_ceiling": step / k["ceiling_gflops"] if step else None,
                     "sweep_rows": sweep["rows"] if sweep else None,
                     "sweep_gflops": sweep["cpu_gflops"] if sweep else None,
                     "of_sweep": step / sweep["cpu_gflops"] if step and sweep else None,
                     "linear_share_of_step": p.get("timers_share", {}).get("linear")})
    return rows


def linear_weights_split(model: str = "smollm2-135m-instruct") -> tuple[int, int]:
    """(weights of the linear layers a token passes through in the body, weights of the LM head)
    of ``model``, counted on an empty (meta-device) copy: nothing is loaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchgen.model_resolver import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model).path)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    head = net.get_output_embeddings()
    body = sum(m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def flop_bound_rows(out: Path, ceilings: dict[str, float] | None = None,
                    weights: tuple[int, int] | None = None) -> list[dict]:
    """How fast each greedy row of ``machine.json`` could possibly be: its linear layers' FLOPs
    run at the machine's best measured GEMM rate, and nothing else costs any time.

    FLOPs = 2 x body weights x (prefill tokens + generated tokens - sequences) + 2 x head weights
    x generated tokens, with batchgen's own token counts (its prefix-cache hits included, which
    vLLM's prefix caching also gets); a sequence's last token is never fed back, its first comes
    from the prefill. The ceiling is the faster of batchgen's GEMM and torch's (oneDNN) on any
    single layer of the model, at 2 threads (``linear_kernel_2t_<dtype>.json``). The bound is
    then ``tokens / (FLOPs / ceiling)``; ``target`` is 1.5 x vLLM's median.
    """
    path = out / "machine.json"
    if not path.is_file():
        return []
    if ceilings is None:
        ceilings = {}
        for dtype in ("float32", "bfloat16"):
            lk = out / f"linear_kernel_2t_{dtype}.json"
            if lk.is_file():
                k = json.loads(lk.read_text())
                ceilings[dtype] = max([k["ceiling_gflops"], *(r["torch_gflops"] for r in k["results"])])
    rows = []
    for key, r in json.loads(path.read_text())["rows"].items():
        if r["mode"]["kind"] != "greedy" or r["dtype"] not in ceilings or not key.endswith(r["dtype"]):
            # only the plain rows: tagged ones (prefill only, other block sizes) are side runs
            continue
        ours = r["peers"].get("batchgen", {})
        best = r.get("best_vllm")
        if not ours.get("runs") or not best or not r["peers"][best].get("summary", {}).get("ok"):
            continue
        if weights is None:
            weights = linear_weights_split()
        body, head = weights
        run = ours["runs"][0]
        stats = run["engine_stats"]
        flops = 2 * body * (stats["num_prefill_tokens"] + stats["num_generated_tokens"] - run["num_sequences"]) \
            + 2 * head * stats["num_generated_tokens"]
        ceiling = ceilings[r["dtype"]]
        bound = run["tokens"] / (flops / (ceiling * 1e9))
        vllm = r["peers"][best]["summary"]["tokens_per_s_median"]
        mine = ours["summary"]["tokens_per_s_median"]
        rows.append({"key": key, "dtype": r["dtype"], "linear_gflop": flops / 1e9, "ceiling_gflops": ceiling,
                     "bound_tokens_per_s": bound, "batchgen": mine, "vllm": vllm,
                     "target": 1.5 * vllm, "target_of_bound": 1.5 * vllm / bound,
                     "batchgen_of_bound": mine / bound, "vllm_of_bound": vllm / bound})
    return rows


def summary_lines(out: Path) -> list[str]:
    """The whole-machine section of ``summary.md``: every row of ``machine.json``, the
    contention run and the GEMM ceiling."""
    path = out / "machine.json"
    lines: list[str] = []
    if path.is_file():
        rows = json.loads(path.read_text())["rows"]
        lines += ["## The whole machine (every peer at every CPU; batchgen at its defaults)", "",
                  "Generated tokens/s, median (min-max) over repeats; ratios batchgen / peer of the medians, "
                  "(min-max) of the per-repeat ratios; vLLM at its fastest block size of the row.", "",
                  "| workload | mode | dtype | threads | repeats | batchgen | batchgen 1 thread | HF generate | "
                  "vLLM (block) | batchgen / vLLM | batchgen / HF | defaults / 1 thread |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key in sorted((k for k in rows if rows[k]["dtype"] != "all"), key=_row_order):
            r = rows[key]
            peers, ratios, best = r["peers"], r["ratios"], r.get("best_vllm")

            def cell(name: str | None) -> str:
                return runner.fmt_cell(peers, name)
            one = ratios.get("batchgen_1t")
            block = f" ({best.split('_bs')[1]})" if best else ""
            mode = key.split("/")[1] + (f" ({key.split(r['dtype'], 1)[1].lstrip('_')})" if not key.endswith(r["dtype"]) else "")
            if r["max_tokens"] != 64:
                mode += f", max_tokens {r['max_tokens']}"
            lines.append(f"| {r['workload'].upper()} ({r['num_prompts']}) | {mode} | {r['dtype']} | "
                         f"{r['threads']} | {r['repeats']} | {cell('batchgen')} | {cell('batchgen_1t')} | "
                         f"{cell('hf_generate')} | {cell(best)}{block} | "
                         f"{runner.fmt_ratio(ratios.get(best) if best else None)} | {runner.fmt_ratio(ratios.get('hf_generate'))} | "
                         f"{runner.fmt_ratio(one)} |")
        lines.append("")
    cont = out / "contention.json"
    if cont.is_file():
        c = json.loads(cont.read_text())
        s = c["summary"]
        lines += [f"Beside CPU-bound processes ({c['workload']}, batchgen at its defaults, "
                  f"{c.get('setup', {}).get('num_threads')} threads): quiet {runner.fmt_summary(s['0'])} tok/s; "
                  + "; ".join(f"{b} busy loop{'s' if b != '1' else ''} {runner.fmt_summary(s[b])} tok/s, quiet / busy "
                              f"{s[b]['slowdown_median']:.2f}× (per repeat {min(s[b]['slowdown_paired']):.2f}-"
                              f"{max(s[b]['slowdown_paired']):.2f})" for b in ("1", "2")) + ".", ""]
    bounds = flop_bound_rows(out)
    if bounds:
        lines += ["The arithmetic bound of each greedy row: its linear layers' FLOPs at the machine's best "
                  "measured GEMM rate (the faster of batchgen's and torch's on any layer, 2 threads), with "
                  "attention, sampling and everything else free.", "",
                  "| row | linear GFLOP | GEMM ceiling GFLOP/s | bound tok/s | batchgen (of bound) | "
                  "vLLM (of bound) | 1.5 × vLLM (of bound) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for b in sorted(bounds, key=lambda b: _row_order(b["key"])):
            lines.append(f"| {b['key']} | {b['linear_gflop']:.0f} | {b['ceiling_gflops']:.1f} | "
                         f"{b['bound_tokens_per_s']:.0f} | {b['batchgen']:.1f} ({b['batchgen_of_bound'] * 100:.0f} %) | "
                         f"{b['vllm']:.1f} ({b['vllm_of_bound'] * 100:.0f} %) | {b['target']:.1f} "
                         f"({b['target_of_bound'] * 100:.0f} %) |")
        lines.append("")
    for row in ceiling_rows(out):
        lines += [f"Decode step's linear layers, {row['dtype']}, 2 threads ({row['decode_rows']} rows): "
                  f"{row['step_linear_gflops']:.1f} GFLOP/s, {row['of_ceiling'] * 100:.0f} % of the kernel's "
                  f"best single-layer rate ({row['ceiling_gflops']:.1f} GFLOP/s) and "
                  f"{row['of_sweep'] * 100:.0f} % of its whole-model sweep at {row['sweep_rows']} rows "
                  f"({row['sweep_gflops']:.1f} GFLOP/s, weights streaming from memory); linear layers "
                  f"{(row['linear_share_of_step'] or 0) * 100:.0f} % of the step.", ""]
    return lines
