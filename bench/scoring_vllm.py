"""The scoring part's vLLM peer, this side: the inputs lm-eval's ``vllm`` model would build,
and the command that scores them in vLLM's own venv (``bench/peers/vllm_scoring.py``).

lm-eval is not installed in vLLM's venv, so its ``vllm`` model cannot run there; what it
does before vLLM is pure tokenisation and slicing, done here with lm-eval's own functions
(:func:`inputs`), and what it does with vLLM's output (the per-request sums) is the worker's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("BENCH_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
BLOCK_SIZE = 32  # vLLM's CPU build refuses 16
KV_GIB = 1


def inputs(tokenizer, kind: str, work: dict, max_length: int) -> dict[str, Any]:
    """lm-eval ``vllm``'s inputs for the workload, as its ``_loglikelihood_tokens`` cuts them:
    ``{"inputs": [[ids, ctxlen]...], "owner": [text index per input]}`` (``owner`` for ``ppl``
    only). Pairs tokenise as every lm-eval model does (``TemplateLM._encode_pair``); rolling
    windows are ``get_rolling_token_windows(max_seq_len=max_length - 2, context_len=1)`` made
    disjoint, as ``VLLM.loglikelihood_rolling`` builds them (one token shorter than ``hf``'s)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from batchgen.engine.loglikelihood import encode, encode_pair, prefix_token_id

    max_ctx = max_length - 1  # vLLM needs one generated token
    pairs, owner = [], []
    if kind == "mc":
        pairs = [encode_pair(tokenizer, c, x) for c, x in work["pairs"]]
    else:
        for i, text in enumerate(work["texts"]):
            windows = get_rolling_token_windows(encode(tokenizer, text), prefix_token_id(tokenizer), max_length - 2, 1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owner.append(i)
    inputs = [[(ctx + cont)[-max_ctx:], len(ctx) - max(0, len(ctx) + len(cont) - max_ctx)] for ctx, cont in pairs]
    return {"inputs": inputs, "owner": owner}


def inputs_path(workload: Path, max_length: int) -> Path:
    """Where :func:`write_inputs` put the vLLM inputs of ``workload``."""
    return workload.with_name(f"{workload.stem}-vllm{max_length}.json")


def write_inputs(tokenizer, kind: str, work: dict, workload: Path, max_length: int) -> None:
    inputs_path(workload, max_length).write_text(json.dumps(inputs(tokenizer, kind, work, max_length)))


def command(model: str, inputs_file: Path, dtype: str, max_length: int, env: dict[str, str],
            threads: int) -> list[str]:
    """The worker's command line; ``env`` gets vLLM's CPU settings (KV space, thread binding,
    no engine subprocess)."""
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    options = {"dtype": dtype, "max_model_len": max_length, "block_size": BLOCK_SIZE}
    return [str(VLLM_PYTHON), str(REPO / "bench" / "peers" / "vllm_scoring.py"), model, str(inputs_file),
            json.dumps(options)]


def sum_windows(res: dict, workload: Path) -> dict:
    """vLLM's per-window rolling results summed per text (``owner``)."""
    if "error" in res:
        return res
    owner = json.loads(workload.read_text())["owner"]
    totals = [0.0] * (max(owner) + 1)
    for i, lp in zip(owner, res["loglikelihoods"]):
        totals[i] += lp
    return {**res, "loglikelihoods": totals}
