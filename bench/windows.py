"""What releasing the KV blocks behind a sliding window buys: ``python -m bench.windows --out FILE``.

A random Mistral-shaped model (every layer slides: hidden 512, 4 layers, 8 heads and 2 KV
heads of 64, a window of ``--window`` 256 tokens; SmolLM2's tokenizer and vocabulary) generates
greedily, EOS ignored, ``--rows`` 32 rows of a 64-token random prompt and ``--max-tokens`` 960
tokens each (1,024 in all: 64 blocks of 16 a row, 2,048 for the batch) in a KV cache of
``--cache-blocks`` 640 blocks, float32, at ``--threads``. Two engines, interleaved for
``--repeats``:

* ``release``: batchgen as it runs (the blocks wholly behind each row's window go back to the
  pool, ``BlockManager.release_behind_window``);
* ``keep``: the same with ``ModelRunner.kv_window`` patched to None (every block kept until the
  row ends: what batchgen did before, and what an engine without the release does).

Each run records its wall time and tokens/s, the peak of blocks in use, preemptions and the
blocks released; the two must generate the same tokens (checked). The JSON keeps every run; the
plot shows tokens/s and peak blocks side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.quant_kernel import cpu_name
from bench.records import machine
from bench.roofline import ISA_FLAGS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=960)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--cache-blocks", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    return ap


HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 512, 4, 8, 2, 64, 16


def build_model(folder: Path, window: int) -> str:
    """The random Mistral-shaped model (seed 0) with SmolLM2's tokenizer, saved in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from batchgen.model_resolver import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mistral", vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        sliding_window=window, max_position_embeddings=4096, initializer_range=0.05,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=1)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _engine(path: str, args: argparse.Namespace, release: bool) -> Any:
    """The engine of one run: ``--cache-blocks`` blocks, the release on or patched off."""
    from transformers import AutoConfig

    from batchgen import LLM
    from batchgen.engine.model_loader import cache_shape
    from batchgen.engine.model_runner import ModelRunner

    per_block = cache_shape(AutoConfig.from_pretrained(path), BLOCK, torch.float32).bytes_per_block
    settings: dict[str, Any] = dict(dtype="float32", block_size=BLOCK, num_threads=args.threads, max_num_seqs=256,
                                    kv_cache_memory=args.cache_blocks * per_block)
    if release:
        return LLM(path, **settings)
    with mock.patch.object(ModelRunner, "kv_window", property(lambda self: None)):  # read once, by the engine
        return LLM(path, **settings)


def one_run(path: str, prompts: list[list[int]], args: argparse.Namespace, release: bool) -> dict[str, Any]:
    """One engine's run (see the module docstring); its tokens under ``tokens``."""
    from batchgen import SamplingParams

    llm = _engine(path, args, release)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    bm = llm.engine.block_manager
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"release": release, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "num_blocks": llm.runner.num_blocks, "window": bm.window, "peak_blocks_used": bm.peak_blocks_used,
            "num_preemptions": llm.scheduler.num_preemptions, "num_released_blocks": bm.num_released_blocks,
            "tokens": tokens}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine: median tokens/s (and the range), peak blocks, preemptions; release over keep
    per repeat."""
    out: dict[str, Any] = {}
    for name, flag in (("release", True), ("keep", False)):
        mine = [r for r in runs if r["release"] is flag]
        rates = [r["tokens_per_s"] for r in mine]
        out[name] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_range": [min(rates), max(rates)],
                     "peak_blocks_used": max(r["peak_blocks_used"] for r in mine),
                     "num_preemptions": max(r["num_preemptions"] for r in mine),
                     "num_released_blocks": max(r["num_released_blocks"] for r in mine)}
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
              zip([r for r in runs if r["release"]], [r for r in runs if not r["release"]])]
    out["release_over_keep"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """tokens/s and peak blocks in use, release against keep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    names = ["keep", "release"]
    rates = [s[n]["tokens_per_s"] for n in names]
    err = [[r - s[n]["tokens_per_s_range"][0] for r, n in zip(rates, names)],
           [s[n]["tokens_per_s_range"][1] - r for r, n in zip(rates, names)]]
    ax1.bar(names, rates, yerr=err, color=["tab:gray", "tab:blue"])
    ax1.set_ylabel("tokens/s (median of repeats)")
    ax1.set_title(f"{result['rows']} rows x {result['total_tokens']} tokens, window {result['window']}")
    ax2.bar(names, [s[n]["peak_blocks_used"] for n in names], color=["tab:gray", "tab:blue"])
    ax2.axhline(result["cache_blocks"], color="red", lw=0.8, label="cache")
    ax2.set_ylabel("peak KV blocks in use (of 16 tokens)")
    ax2.set_title(f"preemptions: keep {s['keep']['num_preemptions']}, release {s['release']['num_preemptions']}")
    ax2.legend(fontsize=8)
    fig.suptitle(f"sliding-window release, random Mistral shape, {result['threads']} threads, {result['cpu']} "
                 f"({', '.join(result['isa'])})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = _parser().parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "mistral", args.window)
        prompts = [torch.randint(3, 40_000, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.rows)]
        runs = []
        for repeat in range(args.repeats):
            for release in ((True, False) if repeat % 2 == 0 else (False, True)):
                runs.append(one_run(path, prompts, args, release))
                print(f"repeat {repeat} {'release' if release else 'keep'}: {runs[-1]['tokens_per_s']:.0f} tok/s, "
                      f"peak {runs[-1]['peak_blocks_used']} blocks, {runs[-1]['num_preemptions']} preemptions",
                      flush=True)
    first = runs[0]["tokens"]
    assert all(r["tokens"] == first for r in runs), "the release changed the generated tokens"
    for r in runs:
        del r["tokens"]
    from batchgen.kernels.cpu import c_build

    flags = c_build.cpu_flags() or frozenset()
    result = {"machine": machine(), "cpu": cpu_name(), "isa": sorted(f for f in flags if f in ISA_FLAGS),
              "threads": args.threads, "rows": args.rows,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "total_tokens": args.prompt_tokens + args.max_tokens, "window": args.window,
              "cache_blocks": args.cache_blocks, "block_size": BLOCK, "same_tokens": True,
              "summary": summarize(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
