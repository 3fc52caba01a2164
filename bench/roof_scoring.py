"""A scoring row of the roofline (:mod:`bench.roofline`): one rolling-perplexity window.

Rolling perplexity (lm-eval's ``loglikelihood_rolling``) runs a text as windows of ``max_length``
tokens, each one prefill whose every position is scored: the linear layers on every row, the
lm_head too, and causal attention over the window. Its roof has two parts that share the cores,
so they add up: the linear layers' operations at the int8 ceiling (``gguf``) or the float32
one, and attention's, which is float32 in either mode (the invariance rule keeps its order and
type, ``docs/evaluation.md``), at the float32 FMA ceiling. ``of_roof`` is that bound's time over
the window's measured time; ``gops`` and ``of_ceiling`` stay the linear layers' alone, as in the
other rows, so that the point sits on the same plot.

Attention's operations: causal QK and PV, ``4 x heads x head_size x n(n+1)/2`` per layer (the
count ``bench.profile_scoring`` reports GFLOP/s by). The text is lm-eval's kind
(:func:`bench.scoring_workload.ppl_texts`); the fastest of ``repeats`` windows is the figure.
"""

from __future__ import annotations

import time
from typing import Any

from bench.roof_math import Weight, attention_flops, causal_keys, roof_fields, step_bytes, step_roof_fields, step_ops
from bench.scoring_workload import ppl_texts

WINDOW = 2048


def window_fields(ops: int, attn: int, nbytes: int, seconds: float, roof: dict, ceiling: str) -> dict:
    """A window against the roof: the linear layers' rates (:func:`bench.roof_math.roof_fields`),
    then the whole step's bound, linear and attention work together
    (:func:`bench.roof_math.step_roof_fields`, which reads no K/V here: the window computes it),
    and the fraction of it reached."""
    fields = roof_fields(ops, nbytes, seconds, roof["bandwidth_gbs"], roof[f"{ceiling}_gops"])
    fields.update(step_roof_fields(ops, nbytes, 0, attn, seconds, roof, ceiling))
    fields.update(bound_s=fields["step_bound_s"], of_roof=fields["of_step_roof"], bound=f"{ceiling} + attention")
    return fields


def rolling_row(llm: Any, weights: list[Weight], roof: dict, ceiling: str, repeats: int) -> dict:
    """The row of one rolling-perplexity window of :data:`WINDOW` tokens on ``llm``, against
    ``roof`` (see the module docstring)."""
    tokens = llm.tokenizer.encode(" ".join(ppl_texts(llm.tokenizer, WINDOW + 200)))[:WINDOW]
    llm.loglikelihood_rolling([tokens[:64]], max_length=WINDOW)  # warm-up
    times = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        llm.loglikelihood_rolling([tokens], max_length=WINDOW)
        times.append(time.perf_counter() - start)
    share = (time.process_time() - c0) / (2 * (time.perf_counter() - t0))
    ops, attn = step_ops(weights, len(tokens)), attention_flops(llm.runner.model.config, causal_keys(len(tokens)))
    nbytes, median = step_bytes(weights), sorted(times)[len(times) // 2]
    row = {"kind": f"rolling ppl {len(tokens)}", "batch": 1, "cpu_share": share, "steps": len(times),
           "step_s": min(times), "step_median_s": median, "ops_per_step": ops, "attention_flops": attn,
           "weight_bytes_per_step": nbytes, "ceiling": ceiling, "roof": roof}
    row.update(window_fields(ops, attn, nbytes, min(times), roof, ceiling))
    row["of_roof_median"] = window_fields(ops, attn, nbytes, median, roof, ceiling)["of_roof"]
    return row
