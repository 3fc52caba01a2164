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
import time
from pathlib import Path

from bench import model_shapes
from bench.engine_parts import (greedy_agreement, part_blocksize, part_lengths, part_profile, part_scaling,
                                part_sharing, part_throughput)
from bench.records import MODES, RESULTS, log, machine, save, strip_outputs, vllm_status

ALL_PARTS = ["throughput", "sharing", "blocksize", "lengths", "scaling", "profile", "scaleout"]
EXTRA_PARTS = ["prefix", "structured", "machine", "contention", "scoring", "roof", "lora"]


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

def parser() -> argparse.ArgumentParser:
    """The suite's command line: every part's options, each help naming the parts it is for (one
    add_argument per option, a flat table: longer than a screen by its nature)."""
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
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, lists split and ``--quick`` applied; unknown parts or modes exit
    with the lists to choose from."""
    ap = parser()
    args = ap.parse_args(argv)
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
    args.parts = parts
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    if not args.report_only:
        started = time.time()
        fns = {"throughput": part_throughput, "sharing": part_sharing, "blocksize": part_blocksize,
               "lengths": part_lengths, "scaling": part_scaling, "profile": part_profile,
               "scaleout": part_scaleout, "prefix": part_prefix, "structured": part_structured,
               "machine": part_machine, "contention": part_contention,
               "scoring": part_scoring, "roof": part_roof, "lora": part_lora}
        for p in args.parts:
            t0 = time.time()
            fns[p](args, out)
            log(f"part {p} took {time.time() - t0:.0f} s")
        log(f"all parts took {time.time() - started:.0f} s")
    from bench import report

    report.build(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
