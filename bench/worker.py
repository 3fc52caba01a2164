"""One peer in its own process: ``python -m bench.worker <peer> <json options>``.

Protocol (shared with ``bench/peers/vllm_worker.py``): after the peer is built and warmed up
the worker prints ``@@READY <setup json>``; then, for each JSON command read from stdin
(``prompts``, ``mode``, ``max_tokens``, ``seed``), it prints ``@@RESULT <json>`` (the peer's
result plus the process's peak RSS so far) or ``@@ERROR <json>``. Library chatter goes to
stderr. The torch thread count is set before anything else runs (unless it is 0: the peer's default).
"""

from __future__ import annotations

import json
import resource
import sys
import traceback


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """Resident set size of this process now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def build(peer: str, options: dict):
    """The peer object named ``peer``.

    Raises:
        ValueError: an unknown peer name.
    """
    from batchgen.model_resolver import resolve_model

    path = resolve_model("smollm2-135m-instruct").path
    if peer == "batchgen":
        from bench.peers.batchgen_peer import BatchgenPeer
        return BatchgenPeer(**options)
    if peer == "hf_generate":
        from bench.peers.hf_generate import HFGenerate
        return HFGenerate(path, **options)
    if peer == "hf_generate_xgrammar":
        from bench.peers.hf_generate_xgrammar import HFGenerateXGrammar
        return HFGenerateXGrammar(path, **options)
    if peer == "hf_generate_batch":
        from bench.peers.hf_generate_batch import HFGenerateBatch
        return HFGenerateBatch(path, **options)
    raise ValueError(f"unknown peer {peer!r}; choose batchgen, hf_generate, hf_generate_xgrammar or "
                     "hf_generate_batch")


def main() -> None:
    peer_name, raw = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    options = json.loads(raw)
    threads = int(options.pop("threads", 1))
    import torch

    if threads:  # 0: the peer's own default
        torch.set_num_threads(threads)
    from bench.peers import UnsupportedMode

    import transformers  # noqa: F401 - every peer's imports, before the model: what the RSS counts from

    if peer_name == "batchgen":
        from bench.peers.batchgen_peer import BatchgenPeer

        BatchgenPeer.preload()
    before = rss_mib()
    peer = build(peer_name, options)
    print("@@READY " + json.dumps({**peer.setup(), "rss_before_load_mib": before,
                                   "rss_after_load_mib": peak_rss_mib()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            res = peer.run(cmd["prompts"], cmd["mode"], cmd["max_tokens"], cmd["seed"])
            res["peak_rss_mib"] = peak_rss_mib()
            print("@@RESULT " + json.dumps(res), flush=True)
        except UnsupportedMode as exc:
            print("@@ERROR " + json.dumps({"unsupported": str(exc)}), flush=True)
        except Exception as exc:  # recorded by the caller with the traceback
            print("@@ERROR " + json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()[-4000:],
                                           "peak_rss_mib": peak_rss_mib()}), flush=True)


if __name__ == "__main__":
    main()
