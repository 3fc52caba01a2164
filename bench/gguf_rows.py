"""The GGUF rows of the machine part: batchgen's GGUF-native path against its float paths,
vLLM and llama.cpp, and a 1B model where memory matters.

``python -m bench --parts machine --dtype all`` (W32 or W256, ``--workload``) runs, interleaved
per repeat, both cores each, greedy with EOS ignored (every peer generates exactly
``max_tokens`` per prompt, so all do the same work):

* ``batchgen`` (float32, the de-quantized model: ``quantization: none``), ``batchgen_bf16``
  and ``batchgen_gguf`` (the embedded Q4_1 file kept quantized: ``quantization: gguf``,
  float32 activations and KV cache), and ``batchgen_gguf_bf16`` (the same blocks, ``dtype:
  bfloat16``: bfloat16 activations between the int8 layers and a bfloat16 KV cache);
* ``vllm_bs<B>`` and ``vllm_bf16_bs<B>``: vLLM's CPU build in float32 and bfloat16 (block size
  the first of ``--vllm-block-sizes``);
* ``llama_cpp`` and ``llama_cpp_split``: llama.cpp on the same Q4_1 file, all sequences in one
  ``llama_decode`` per step (``bench/peers/llama_cpp_worker.py``), over a unified KV cache and
  over one KV stream per sequence (:func:`llama_cpp_peers` says why both).

``--workload`` one of :data:`bench.model_shapes.WORKLOADS` (with ``--batches 1,8,64``) runs a
random-weight GGUF file shaped like a model people download (:mod:`bench.model_shapes`: a
Llama-3.2-1B-shaped Llama in Q4_K or Q8_0, a Qwen2.5-1.5B-shaped ``qwen2`` and a
Gemma-2-2B-shaped ``gemma2``, both quantized by llama.cpp to ``Q4_K_M``), written once to
``/tmp/bench-models``. Each batch size is a row: that many random 32-token prompts (``--prompt-tokens``;
another length adds ``/p<N>`` to the row's key, and ``--max-tokens 1`` makes it a prefill row),
``max_tokens`` each; peers ``batchgen_gguf``, ``llama_cpp`` and ``llama_cpp_split`` (``--peers``
adds ``batchgen``, the de-quantized float32 model). batchgen's KV cache is sized to the row (all
sequences at their full length, rounded up), so peak RSS compares with file + KV cache.

Rows go into ``machine.json`` keyed ``<workload>/greedy_ignore_eos/all<--tag>`` and
``<workload>/b<batch>/greedy_ignore_eos<--tag>``; each records both peers' ratios to
``batchgen_gguf`` as well as to ``batchgen``, and, for the file rows, the file's size, the KV
bytes and peak RSS over (file + KV).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from bench import model_shapes, runner
from bench.model_shapes import Shape

GIB = 2**30
MIB = 2**20
PROMPT_TOKENS = 32
MODE = {"kind": "greedy", "ignore_eos": True}


def one_b_model(qtype: str) -> Path:
    """The 1B random Llama in ``qtype`` (``Q4_K`` or ``Q8_0``), written on first use."""
    return model_shapes.model_file(f"1b-{qtype.lower()}")[0]


def random_prompts(n: int, vocab: int, length: int = PROMPT_TOKENS, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from the non-special ids."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def embedded_gguf() -> str:
    from batchgen.model_resolver import resolve_model

    return resolve_model("smollm2-135m-instruct", "gguf", "cpu").gguf_file


def llama_cpp_peers(gguf: str, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """llama.cpp with a unified KV cache (``llama_cpp``: one pool of cells for all sequences,
    sized to their sum) and with one KV stream per sequence (``llama_cpp_split``, each of the
    longest sequence's length). With a unified cache every sequence's attention runs over every
    cell (masked), so a step costs about sequences x all cells: 2.2x the split cache's at 64
    sequences of W32 (398 against 179 ms a step), quadratic beyond."""
    n = min(len(prompts), 256)
    longest = max(map(len, prompts)) + max_tokens + 8
    return {"llama_cpp": {"as": "llama_cpp", "gguf": gguf, "n_seq_max": n, "kv_unified": True,
                          "n_ctx": sum(len(p) + max_tokens for p in prompts[:n]) + 256},
            "llama_cpp_split": {"as": "llama_cpp", "gguf": gguf, "n_seq_max": n, "kv_unified": False,
                                "n_ctx": n * longest}}


def all_peers(args: Any, prompts: list[list[int]]) -> dict[str, dict]:
    """The peers of a SmolLM2 row (module docstring), filtered by ``--peers``."""
    bs = next((b for b in args.vllm_block_sizes if b != "best"), 128)
    peers = {
        "batchgen": {"as": "batchgen", "kv_cache_memory": GIB, "dtype": "float32", "quantization": "none",
                     "threads": 0},
        "batchgen_bf16": {"as": "batchgen", "kv_cache_memory": GIB, "dtype": "bfloat16", "quantization": "none",
                          "threads": 0},
        "batchgen_gguf": {"as": "batchgen", "kv_cache_memory": GIB, "dtype": "float32", "quantization": "gguf",
                          "threads": 0},
        "batchgen_gguf_bf16": {"as": "batchgen", "kv_cache_memory": GIB, "dtype": "bfloat16",
                               "quantization": "gguf", "threads": 0},
        f"vllm_bs{bs}": {"as": "vllm", "kv_gib": 1, "dtype": "float32", "block_size": bs},
        f"vllm_bf16_bs{bs}": {"as": "vllm", "kv_gib": 1, "dtype": "bfloat16", "block_size": bs},
        **llama_cpp_peers(embedded_gguf(), prompts, args.max_tokens),
    }
    return runner.select_peers(peers, args.peers)


def file_peers(args: Any, path: Path, shape: Shape, batch: int, max_tokens: int) -> tuple[dict[str, dict], int]:
    """The peers of a file row and batchgen's KV cache bytes (all ``batch`` sequences at full
    length, rounded up to whole 16-token blocks, plus one block per sequence)."""
    prompt_tokens = getattr(args, "prompt_tokens", PROMPT_TOKENS)
    blocks = batch * (math.ceil((prompt_tokens + max_tokens) / 16) + 1)
    kv = blocks * 16 * shape.kv_bytes_per_token()
    common = {"as": "batchgen", "model": str(path), "kv_cache_memory": kv, "dtype": "float32", "threads": 0}
    peers = {"batchgen_gguf": {**common, "quantization": "gguf"}}
    if "batchgen" in args.peers:
        peers["batchgen"] = {**common, "quantization": "none"}
    cpp = llama_cpp_peers(str(path), [[0] * prompt_tokens] * batch, max_tokens)
    peers.update(cpp if batch > 1 else {"llama_cpp": cpp["llama_cpp"]})  # one sequence: the same either way
    return runner.select_peers(peers, args.peers), kv


def _row(res: dict, prompts: list[list[int]], args: Any, threads: int, machine: dict, started: str,
         **extra: Any) -> dict:
    ours = res.get("batchgen_gguf", {}).get("runs")
    same = None
    if ours:
        first = ours[0]["outputs"]
        same = {k: sum(a == b for a, b in zip(first, v["runs"][0]["outputs"]))
                for k, v in res.items() if k != "batchgen_gguf" and v.get("runs")}
    ratios = {"batchgen": runner.ratios(res, "batchgen"), "batchgen_gguf": runner.ratios(res, "batchgen_gguf")}
    return {"num_prompts": len(prompts), "mode": MODE, "dtype": "all", "max_tokens": args.max_tokens,
            "threads": threads, "repeats": args.repeats_greedy, "peers": res, "ratios": ratios["batchgen"],
            "ratios_to_gguf": ratios["batchgen_gguf"], "identical_outputs_vs_gguf": same,
            "machine": machine, "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def part(args: Any, result: dict, prompts_of: Callable[[str], list[list[int]]], log: Callable[[str], None],
         machine: dict, strip: Callable[[dict], None], save: Callable[[dict], None], threads: int) -> None:
    """Run the rows ``--workload`` and ``--dtype all`` ask for into ``result["rows"]``."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.workload in model_shapes.WORKLOADS:
        path, shape = model_shapes.model_file(args.workload)
        file_bytes = path.stat().st_size
        log(f"machine {args.workload}: {path} ({file_bytes / MIB:.0f} MiB), batches {args.batches}")
        for batch in args.batches:
            prompts = random_prompts(batch, shape.vocab, args.prompt_tokens)
            peers, kv = file_peers(args, path, shape, batch, args.max_tokens)
            length = "" if args.prompt_tokens == PROMPT_TOKENS else f"/p{args.prompt_tokens}"
            key = f"{args.workload}/b{batch}{length}/greedy_ignore_eos{args.tag}"
            log(f"machine {key}: {list(peers)} x {args.repeats_greedy} repeats, KV {kv / MIB:.0f} MiB")
            res = runner.interleaved(peers, prompts, MODE, args.max_tokens, args.repeats_greedy, args.log_dir,
                                     threads, run_timeout=args.run_timeout, on_event=log)
            rss = {k: v.get("peak_rss_mib") for k, v in res.items()}
            grown = {k: v - res[k]["setup"]["rss_before_load_mib"] for k, v in rss.items()
                     if v and "rss_before_load_mib" in res[k].get("setup", {})}
            result["rows"][key] = _row(res, prompts, args, threads, machine, started, workload=args.workload,
                                       batch=batch, gguf=str(path), file_bytes=file_bytes, kv_cache_bytes=kv,
                                       peak_rss_mib=rss, peak_rss_over_file_plus_kv={
                                           k: v * MIB / (file_bytes + kv) for k, v in rss.items() if v},
                                       peak_rss_above_start_mib=grown, peak_rss_above_start_over_file_plus_kv={
                                           k: v * MIB / (file_bytes + kv) for k, v in grown.items()})
            strip(res)
            save(result)
            _log_ratios(result["rows"][key], log)
        return
    prompts = prompts_of(args.workload)
    peers = all_peers(args, prompts)
    key = f"{args.workload}/greedy_ignore_eos/all{args.tag}"
    log(f"machine {key}: {len(prompts)} prompts, {threads} threads, {list(peers)} x {args.repeats_greedy} repeats")
    res = runner.interleaved(peers, prompts, MODE, args.max_tokens, args.repeats_greedy, args.log_dir, threads,
                             run_timeout=args.run_timeout, on_event=log)
    result["rows"][key] = _row(res, prompts, args, threads, machine, started, workload=args.workload,
                               gguf=embedded_gguf(), best_vllm=None)
    strip(res)
    save(result)
    _log_ratios(result["rows"][key], log)


def _log_ratios(row: dict, log: Callable[[str], None]) -> None:
    for name, r in row["ratios_to_gguf"].items():
        log(f"  batchgen_gguf / {name}: {r['of_medians']:.2f}x (paired {[round(x, 2) for x in r['paired_all']]})")


def color(name: str) -> str:
    """The plot's colour of a peer."""
    return ("#1f5fa8" if name == "batchgen_gguf" else "#6a9fd4" if name.startswith("batchgen") else
            "#d4762a" if name.startswith("vllm") else "#3a9a4a" if name.startswith("llama_cpp") else "#888")


def gguf_keys(rows: dict) -> list[str]:
    """The GGUF rows of ``machine.json``: SmolLM2 rows first (W32, W256), then the file ones by
    workload and batch."""
    keys = [k for k in rows if rows[k]["dtype"] == "all"]
    return sorted(keys, key=lambda k: (rows[k]["workload"] in model_shapes.WORKLOADS, rows[k]["workload"],
                                       rows[k].get("batch", 0), k))


def ceiling_lines(out: Path) -> list[str]:
    """The decode step's quantized linear layers in int8 GOP/s (``profile_2t_gguf*.json``, from
    ``bench.profile_step --quantization gguf``) against the int8 ceiling (``vpdpbusd`` or
    ``vpmaddubsw`` at 2 threads: the ``peaks`` of the ``bench.quant_kernel`` run made on the
    same CPU, ``quant_kernel_epyc.json`` else ``quant_kernel.json``)."""
    import json

    kernel = next((json.loads(f.read_text()) for f in (out / "quant_kernel_epyc.json", out / "quant_kernel.json")
                   if f.is_file()), None)
    lines = []
    for prof in sorted(out.glob("profile_2t_gguf*.json")):
        p = json.loads(prof.read_text())
        if kernel is None or not p.get("linear_gflops_median"):
            continue
        peaks = kernel.get("peaks", {})
        name, ceiling = max(((k, v) for k, v in peaks.items() if k.startswith("int8") and k.endswith("_2t")),
                            key=lambda kv: kv[1], default=(None, None))
        if ceiling is None:
            continue
        lines.append(f"Decode step's quantized linear layers, {Path(p.get('model', '?')).name}, 2 threads "
                     f"({p['decode_rows_median']} rows): {p['linear_gflops_median']:.0f} GOP/s, "
                     f"{p['linear_gflops_median'] / ceiling * 100:.0f} % of the int8 ceiling "
                     f"({name}: {ceiling:.0f} GOP/s on {kernel.get('cpu', '?')}); linear layers "
                     f"{p['timers_share'].get('linear', 0) * 100:.0f} % of the step, attention "
                     f"{p['timers_share'].get('attention', 0) * 100:.0f} %.")
        lines.append("")
    return lines


def summary_lines(rows: dict, out: Path | None = None) -> list[str]:
    """The GGUF section of ``summary.md``: tokens/s of every peer, batchgen_gguf's ratios, for
    the file rows peak RSS against file + KV cache, and the step's linear layers against the
    int8 ceiling (:func:`ceiling_lines`)."""
    keys = gguf_keys(rows)
    if not keys:
        return []
    lines = ["## GGUF-native (greedy, EOS ignored: every peer generates max_tokens per prompt)", "",
             "Generated tokens/s, median (min-max) over interleaved repeats, both cores per peer; ratios "
             "batchgen_gguf / peer of the medians, (min-max) of the per-repeat ratios.", "",
             "| row | batchgen fp32 | batchgen bf16 | batchgen gguf | vLLM fp32 | vLLM bf16 | llama.cpp unified KV | "
             "llama.cpp split KV | gguf / fp32 | gguf / bf16 | gguf / vLLM fp32 | gguf / llama.cpp unified | "
             "gguf / llama.cpp split | fp32 / vLLM fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in keys:
        r = rows[key]
        peers, to_gguf = r["peers"], r["ratios_to_gguf"]
        vllm = next((k for k in peers if k.startswith("vllm_bs")), None)
        vllm16 = next((k for k in peers if k.startswith("vllm_bf16")), None)
        label = f"{key} ({r['num_prompts']} prompts x {r['max_tokens']})"
        cells = [runner.fmt_cell(peers, name) for name in
                 ("batchgen", "batchgen_bf16", "batchgen_gguf", vllm, vllm16, "llama_cpp", "llama_cpp_split")]
        ratios = [runner.fmt_ratio(to_gguf.get(name)) for name in
                  ("batchgen", "batchgen_bf16", vllm, "llama_cpp", "llama_cpp_split")]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + f" | {runner.fmt_ratio(r['ratios'].get(vllm))} |")
    lines.append("")
    mem = [k for k in keys if "file_bytes" in rows[k]]
    if mem:
        lines += ["Memory of the file rows: peak RSS of each peer's process (load included), and its growth from "
                  "before the model loads (the interpreter and libraries imported: torch, transformers and "
                  "batchgen's engine for batchgen, numpy and llama_cpp for llama.cpp), each against the GGUF file plus batchgen's KV "
                  "cache (sized to the row).", "",
                  "| row | file MiB | KV MiB | batchgen gguf peak RSS MiB (× file+KV) | its growth from start | "
                  "llama.cpp (unified) peak RSS MiB (× file+KV) | its growth from start | batchgen fp32 "
                  "(de-quantized) peak RSS MiB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key in mem:
            r = rows[key]
            rss, over = r["peak_rss_mib"], r["peak_rss_over_file_plus_kv"]
            grown, grown_over = r.get("peak_rss_above_start_mib", {}), r.get("peak_rss_above_start_over_file_plus_kv", {})

            def m(name: str, values: dict, ratios: dict) -> str:
                return f"{values[name]:.0f} ({ratios[name]:.2f}×)" if values.get(name) else "–"
            lines.append(f"| {key} | {r['file_bytes'] / MIB:.0f} | {r['kv_cache_bytes'] / MIB:.0f} | "
                         f"{m('batchgen_gguf', rss, over)} | {m('batchgen_gguf', grown, grown_over)} | "
                         f"{m('llama_cpp', rss, over)} | {m('llama_cpp', grown, grown_over)} | "
                         f"{m('batchgen', rss, over)} |")
        lines.append("")
    return lines + (ceiling_lines(out) if out is not None else [])
