"""The suite's engine parts on W32 and W256 (``python -m bench --parts ...``): ``throughput``
(the modes against HF and vLLM), ``sharing``, ``blocksize``, ``lengths``, ``scaling`` and
``profile``; each takes the parsed arguments and the results folder and saves its JSON (see
``bench/__main__.py`` for what each measures).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench import runner
from bench.records import GIB, MIB, MODES, log, machine, save, strip_outputs, vllm_status
from bench.workload import w32_prompts, w256_prompts


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
