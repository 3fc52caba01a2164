"""llama.cpp (through ``llama-cpp-python``) as a benchmark peer on a GGUF file.

This file imports only the standard library, numpy and ``llama_cpp``, so that it can run in a
separate virtual environment (``python -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install
llama-cpp-python``) as well as in batchgen's own (``pip install 'batchgen[gguf-oracle]'``). It
speaks the worker protocol of ``bench/worker.py``: one ``@@READY <json>`` line, then for each
JSON command on stdin one ``@@RESULT <json>`` or ``@@ERROR <json>`` line.

It drives llama.cpp's own batched API, as its ``batched`` example does, not the one-sequence
``Llama`` class:

* one context with a **unified** KV cache (``kv_unified``) over ``n_ctx`` cells shared by up to
  ``n_seq_max`` sequences (llama.cpp's limit is 256), ``n_batch`` 2048 and ``n_ubatch`` 512
  tokens, flash attention and the KV type at llama.cpp's defaults, ``n_threads`` and
  ``n_threads_batch`` both ``threads``;
* prefill: the prompts packed into batches of up to ``n_batch`` tokens, each under its own
  sequence id, logits only at each prompt's last token;
* decode: **one** ``llama_decode`` per step holding the next token of every running sequence;
  greedy is the argmax of each row of llama.cpp's logits (numpy over the returned buffer).

With more prompts than ``n_seq_max`` they run in waves of ``n_seq_max``. EOS is honoured unless
the mode says ``ignore_eos``; every sequence otherwise stops at ``max_tokens``. The KV cache is
cleared before every timed run.

Arguments: the GGUF path, then a JSON object of options (``threads``, ``n_ctx``,
``n_seq_max``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback

WARMUP_PROMPT = list(range(1000, 1024))


def _rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class LlamaCppBatched:
    """One llama.cpp model and context; :meth:`generate` runs greedy over many prompts."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_seq_max: int, n_batch: int = 2048,
                 kv_unified: bool = True) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        cparams.n_seq_max = min(n_seq_max, L.llama_max_parallel_sequences())
        cparams.kv_unified = kv_unified
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} cells")
        self.n_batch, self.n_seq_max, self.n_ctx = n_batch, cparams.n_seq_max, n_ctx
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.eos = {L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)} - {-1}
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.setup = {"peer": "llama_cpp", "llama_cpp_python": getattr(L, "__version__", "?"),
                      "gguf": path, "n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": cparams.n_ubatch,
                      "n_seq_max": self.n_seq_max, "kv_unified": kv_unified, "threads": threads,
                      "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
                      "one_decode_per_step": True}

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> "list[int]":
        """One ``llama_decode`` of ``(token, pos, seq_id, wants_logits)`` entries; the argmax of
        the logits rows, in the order of the entries that want them."""
        import numpy as np

        L, b = self.L, self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({len(entries)} tokens; KV cells {self.n_ctx})")
        n_out = sum(1 for e in entries if e[3])
        logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        outs: list[list[int]] = []
        for start in range(0, len(prompts), self.n_seq_max):
            outs += self._wave(prompts[start:start + self.n_seq_max], max_tokens, ignore_eos)
        return outs

    def _wave(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []  # the prompt whose last token each logits row belongs to

        def flush() -> None:
            if pending:
                for seq, tok in zip(owners, self._decode(pending)):
                    outs[seq].append(tok)
                pending.clear()
                owners.clear()

        for seq, prompt in enumerate(prompts):  # prefill, n_batch tokens per decode
            for pos, tok in enumerate(prompt):
                last = pos == len(prompt) - 1
                pending.append((tok, pos, seq, last))
                if last:
                    owners.append(seq)
                if len(pending) == self.n_batch:
                    flush()
        flush()

        def running(seq: int) -> bool:
            out = outs[seq]
            return len(out) < max_tokens and (ignore_eos or out[-1] not in self.eos)

        live = [s for s in range(len(prompts)) if running(s)]
        while live:  # one decode per step, every running sequence's next token
            entries = [(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live]
            for s, tok in zip(live, self._decode(entries)):
                outs[s].append(tok)
            live = [s for s in live if running(s)]
        if not ignore_eos:
            outs = [o[:next((i for i, t in enumerate(o) if t in self.eos), len(o))] for o in outs]
        return outs

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def main() -> None:
    path = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    threads = int(options.get("threads") or len(os.sched_getaffinity(0)))
    import llama_cpp  # noqa: F401 - the library, before the model: what the RSS counts from
    import numpy  # noqa: F401

    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    peer = LlamaCppBatched(path, threads, int(options.get("n_ctx", 16384)), int(options.get("n_seq_max", 256)),
                           kv_unified=bool(options.get("kv_unified", True)))
    peer.generate([WARMUP_PROMPT], 4, True)
    print("@@READY " + json.dumps({**peer.setup, "rss_before_load_mib": before, "rss_after_load_mib": _rss()}),
          flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            mode = cmd["mode"]
            if mode["kind"] != "greedy":
                print("@@ERROR " + json.dumps({"unsupported": f"the llama.cpp peer runs greedy only, not {mode}"}),
                      flush=True)
                continue
            t0 = time.perf_counter()
            outs = peer.generate(cmd["prompts"], cmd["max_tokens"], bool(mode.get("ignore_eos")))
            seconds = time.perf_counter() - t0
            print("@@RESULT " + json.dumps({"seconds": seconds, "tokens": sum(map(len, outs)),
                                            "kv_bytes": None, "outputs": [[o] for o in outs],
                                            "peak_rss_mib": _rss()}), flush=True)
        except Exception as exc:  # recorded by the caller with the traceback
            print("@@ERROR " + json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()[-4000:]}), flush=True)
    peer.close()


if __name__ == "__main__":
    main()
