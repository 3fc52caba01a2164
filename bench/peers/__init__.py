"""Peers of the benchmark: batchgen, HF ``generate``, HF ``generate_batch``, vLLM (CPU).

Every peer runs in its own worker process (see ``bench.worker``), so its peak RSS is its own
and no peer inherits another's thread pools or allocator state. A peer is a class with
``setup() -> dict`` (what it runs, exactly) and ``run(prompts, mode, max_tokens, seed) ->
dict`` returning at least ``seconds`` (the timed ``generate`` call only), ``tokens``
(generated tokens over all returned sequences, the stop token excluded) and ``kv_bytes``.
``mode`` is one of:

* ``{"kind": "greedy"}``
* ``{"kind": "sample", "n": 4, "temperature": 0.8, "top_p": 0.95}``
* ``{"kind": "beam", "beam_width": 4}``
"""

from __future__ import annotations

def strip_at_eos(seq: list[int], eos_ids: "set[int] | list[int]") -> list[int]:
    """Cut at the first EOS (excluded): what follows is padding of a finished row."""
    for i, t in enumerate(seq):
        if t in eos_ids:
            return seq[:i]
    return seq


WARMUP_PROMPT = list(range(1000, 1024))
"""Warm-up prompt shared by all peers: unrelated to any workload prompt, so a prefix cache
cannot carry anything from the warm-up into the timed run."""


class UnsupportedMode(Exception):
    """The peer cannot run this mode at all (recorded as such, not as a failure)."""
