"""The decoder program against the Python layers, in one process: ``python -m bench.decoder_program --out FILE``.

The decoder program (``engine/decoder_program.py``) runs a decode step's layers in one C call; the
Python layers (``FusedDecoderLayer``) call the same kernels one at a time. Both give the same
bits, so the one engine can run either: this part loads each model once and alternates the two,
round by round (the order flipped every other round), by setting the decoder forward's
``program`` aside and back. The same process, weights and caches, minutes apart at most: the
ratio is the program's alone, not the machine's mood between two processes.

Rows (``--models``, comma-separated): ``1b-q4_k`` and ``gemma2-2b-q4_k_m`` (the random 1B
Llama-shaped Q4_K file and the Gemma-2-2B-shaped Q4_K_M file of ``bench.model_shapes``), ``smollm2-q4_1`` (the embedded SmolLM2 file's Q4_1 blocks, ``gguf``
mode), ``smollm2-fp32`` and ``smollm2-bf16`` (the float folder), each at ``--batches``.

A measurement: a greedy generation of ``--tokens`` + 1 tokens from ``batch`` 32-token prompts,
minus one of 1 token (the prefill), over the ``--tokens`` decode steps: the time of one decode
step. Each round checks that both paths gave the same tokens and logprobs, and the JSON says
which CPU and how many threads. ``--rounds`` rounds; the ratio is python / program per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.model_shapes import model_file
from bench.quant_kernel import cpu_name
from bench.records import machine

MODELS = ("1b-q4_k", "gemma2-2b-q4_k_m", "smollm2-q4_1", "smollm2-fp32", "smollm2-bf16")
#: The rows a run without ``--models`` takes: not the Gemma file, whose first writing needs
#: llama.cpp's quantizer (the ``gguf-oracle`` extra) and minutes.
DEFAULT_MODELS = ("1b-q4_k", "smollm2-q4_1", "smollm2-fp32", "smollm2-bf16")
#: The rows that are files of ``bench.model_shapes`` (``gguf`` mode).
SHAPE_FILES = ("1b-q4_k", "gemma2-2b-q4_k_m")


def load(name: str, threads: int):  # noqa: ANN201 - an LLM
    """The engine of row ``name``, its weights loaded once."""
    from batchgen import LLM

    if name in SHAPE_FILES:
        return LLM(str(model_file(name)[0]), quantization="gguf", num_threads=threads)
    if name == "smollm2-q4_1":
        return LLM("smollm2-135m-instruct", quantization="gguf", num_threads=threads)
    dtype = {"smollm2-fp32": "float32", "smollm2-bf16": "bfloat16"}[name]
    return LLM("smollm2-135m-instruct", quantization="none", dtype=dtype, num_threads=threads)


def _logprob(v) -> float:  # noqa: ANN001 - a float, or vLLM's Logprob
    return v if isinstance(v, float) else v.logprob


def step_ms(llm, prompts: list, tokens: int) -> tuple[float, list]:  # noqa: ANN001
    """One decode step's time (ms) over ``tokens`` steps, and what the generation gave."""
    from batchgen import SamplingParams

    full = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True, logprobs=0)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    t1 = time.perf_counter()
    out = llm.generate(prompts, full, use_tqdm=False)
    t2 = time.perf_counter()
    got = [(c.token_ids, [_logprob(next(iter(d.values()))) for d in c.logprobs]) for o in out for c in o.outputs]
    return ((t2 - t1) - (t1 - t0)) / tokens * 1e3, got


def row(name: str, batches: list[int], rounds: int, tokens: int, threads: int) -> list[dict]:
    """Every batch of model ``name``: the two paths alternated, ``rounds`` rounds."""
    llm = load(name, threads)
    forward = llm.runner.model.model.forward
    program = getattr(forward, "program", None)
    if program is None:
        print(f"{name}: no decoder program here (the load log says why); skipped", flush=True)
        return []
    out = []
    for batch in batches:
        prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(batch)]
        times: dict[str, list[float]] = {"program": [], "python": []}
        same = True
        step_ms(llm, prompts, 4)  # warm-up
        for r in range(rounds):
            got = {}
            for path in ("program", "python") if r % 2 == 0 else ("python", "program"):
                forward.program = program if path == "program" else None
                ms, got[path] = step_ms(llm, prompts, tokens)
                times[path].append(ms)
            same = same and got["program"] == got["python"]
        forward.program = program
        ratios = [b / a for a, b in zip(times["program"], times["python"])]
        res = {"model": name, "batch": batch, "step_ms": times, "same_tokens_and_logprobs": same,
               "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
        out.append(res)
        print(f"{name} batch {batch}: program {min(times['program']):.2f} ms, python {min(times['python']):.2f} ms "
              f"a step; {res['speedup']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), same bits {same}", flush=True)
    del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"some of {','.join(MODELS)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps a measurement")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown --models {','.join(unknown)}; choose from {','.join(MODELS)}")
    batches = [int(b) for b in args.batches.split(",")]
    result = {"cpu": cpu_name(), "machine": machine(), "threads": args.threads, "rounds": args.rounds,
              "tokens": args.tokens, "rows": []}
    for name in names:
        result["rows"] += row(name, batches, args.rounds, args.tokens, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
