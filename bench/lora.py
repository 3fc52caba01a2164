"""The ``lora`` part: W32 under 4 LoRA adapters (rank 16, every projection) in one run, against
the same work as merged-adapter runs and against HF + PEFT.

Workload: the W32 prompts (``--num-prompts``), each under each of 4 random PEFT adapters of
rank 16 on q/k/v/o/gate/up/down of SmolLM2-135M (float32), greedy, ``--max-tokens`` tokens with
EOS ignored (every peer generates the same token count).

Peers, in one process, interleaved per repeat (model loads and a warm-up excluded from the
timings; loads reported apart):

* ``batchgen_multi_lora``: one engine (``enable_lora``, ``max_loras=4``), all 4 x W32 requests
  in one ``generate``;
* ``batchgen_merged_sequential``: 4 engines, each on SmolLM2 with one adapter merged into its
  weights (PEFT's ``merge_and_unload``), each running W32: the 4 runs' times summed;
* ``batchgen_merged_one``: one merged engine running 4 x W32 in one ``generate``: the same total
  size without any LoRA (the issue's 0.8x target). The merged engines run without the prefix
  cache, which would otherwise prefill each of the 4 copies of a prompt once, where the
  multi-LoRA run must prefill it once per adapter;
* ``hf_peft``: HF ``generate`` (static left-padded batch of W32) on the PEFT model, looping over
  the adapters with ``set_adapter``.

* ``vllm_multi_lora``: vLLM's CPU build (its own venv, ``bench/peers/vllm_worker.py``) with
  ``enable_lora``, ``max_loras=4``, ``max_lora_rank=16`` and one ``LoRARequest`` per prompt, all
  4 x W32 requests in one ``generate`` (float32, block 32, its prefix cache reset before each
  run; the first run, which loads the adapters, is a warm-up). Where the venv is missing or
  the worker fails, the JSON says why.
Also checked: the multi-LoRA run's tokens equal each merged run's (a merged adapter is a
different float computation, so this counts agreeing rows rather than asserting).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

RANK = 16
NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapters(base: str, root: Path) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(100 + i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                               LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(str(root / f"a{i}"))
        merged = model.merge_and_unload()
        merged.save_pretrained(str(root / f"merged{i}"))
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base).save_pretrained(str(root / f"merged{i}"))
        paths.append(str(root / f"a{i}"))
    return paths


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run_part(args: Any, out: Path, log: Callable[[str], None], machine: Callable[[], dict],
             save: Callable[[str, dict, Path], None]) -> dict:
    import torch

    from batchgen import LoRARequest, SamplingParams
    from batchgen.model_resolver import resolve_model
    from bench.workload import w32_prompts

    torch.set_num_threads(args.threads)
    base = resolve_model("smollm2-135m-instruct").path
    prompts = w32_prompts()[: args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    log(f"lora: {NUM_ADAPTERS} adapters of rank {RANK} in {root}")
    paths = _adapters(base, root)
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    multi, merged, hf, loads = _peers(base, root, paths, args.threads)
    all_prompts = [p for p in prompts for _ in requests]
    all_loras = [r for _ in prompts for r in requests]
    multi.generate(prompts[:2], SamplingParams(max_tokens=2), lora_request=requests[0])  # warm-up
    vllm = _VllmPeer(paths, out, args)
    times: dict[str, list[float]] = {k: [] for k in ("batchgen_multi_lora", "batchgen_merged_sequential",
                                                     "batchgen_merged_one", "hf_peft", "vllm_multi_lora")}
    agree = 0
    for repeat in range(args.repeats):
        vllm.run(all_prompts, times["vllm_multi_lora"])
        multi.reset_prefix_cache()
        t, outs = _timed(lambda: multi.generate(all_prompts, params, lora_request=all_loras))
        times["batchgen_multi_lora"].append(t)
        seq, merged_tokens = 0.0, []
        for llm in merged:
            t, o = _timed(lambda: llm.generate(prompts, params))
            seq += t
            merged_tokens.append([x.outputs[0].token_ids for x in o])
        times["batchgen_merged_sequential"].append(seq)
        times["batchgen_merged_one"].append(_timed(lambda: merged[0].generate(all_prompts, params))[0])
        times["hf_peft"].append(_timed(lambda: _hf_loop(hf, prompts, args.max_tokens))[0])
        agree = sum(outs[j * NUM_ADAPTERS + i].outputs[0].token_ids == merged_tokens[i][j]
                    for i in range(NUM_ADAPTERS) for j in range(len(prompts)))
        log(f"lora repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()))
    vllm.close()
    times = {k: v for k, v in times.items() if v}
    result = _result(args, machine(), len(prompts), times, loads, f"{agree} of {len(all_prompts)}")
    result["vllm"] = vllm.status
    save("lora", result, out)
    _plot(result, out)
    return result


class _VllmPeer:
    """vLLM's CPU build with the same 4 adapters, as a worker process (``bench.runner``)."""

    def __init__(self, paths: list[str], out: Path, args: Any) -> None:
        from bench.runner import VLLM_PYTHON, WorkerError, start_worker

        self.names = [f"a{i}" for i in range(len(paths))]
        self.timeout, self.max_tokens, self.worker = args.run_timeout * 3, args.max_tokens, None
        if args.no_vllm:
            self.status = "not run: --no-vllm"
            return
        if not VLLM_PYTHON.exists():
            self.status = f"not run: no vLLM venv at {VLLM_PYTHON} (see bench/peers/vllm_worker.py)"
            return
        options = {"as": "vllm", "dtype": "float32", "block_size": 32, "max_lora_rank": RANK,
                   "lora_modules": dict(zip(self.names, paths))}
        self.worker = start_worker("vllm_multi_lora", options, args.log_dir, args.threads)
        try:
            self.status = {"setup": self.worker.wait_ready(900)}
        except WorkerError as exc:
            self._fail(f"failed to start: {exc}")
            return
        self.run([[1000 + i for i in range(16)] for _ in self.names], None)  # loads the adapters

    def run(self, prompts: list[list[int]], times: list[float] | None) -> None:
        """One timed generate of ``prompts`` (each name in turn), appended to ``times``."""
        if self.worker is None:
            return
        loras = [self.names[i % len(self.names)] for i in range(len(prompts))]
        mode = {"kind": "greedy", "ignore_eos": True, "loras": loras}
        try:
            res = self.worker.run(prompts, mode, self.max_tokens, 0, self.timeout)
        except Exception as exc:  # a dead or hung worker: recorded, the other peers go on
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if "seconds" not in res:
            self._fail(res.get("error", str(res)))
        elif times is not None:
            times.append(res["seconds"])

    def _fail(self, why: str) -> None:
        self.status = {"error": why[:2000]}
        if self.worker is not None:
            self.worker.kill()
        self.worker = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _peers(base: str, root: Path, paths: list[str], threads: int) -> tuple[Any, list[Any], Any, dict[str, float]]:
    """The multi-LoRA engine, the merged engines, the HF + PEFT model, and their load times."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from batchgen import LLM

    engine = dict(dtype="float32", device="cpu", num_threads=threads)
    loads: dict[str, float] = {}
    loads["batchgen_multi_lora"], multi = _timed(lambda: LLM(base, enable_lora=True, max_loras=NUM_ADAPTERS,
                                                            max_lora_rank=RANK, **engine))
    merged = []
    for i in range(NUM_ADAPTERS):
        # no prefix cache: W32 x 4 on one merged model would prefill each prompt once, where
        # the multi-LoRA run must prefill it once per adapter
        t, llm = _timed(lambda: LLM(str(root / f"merged{i}"), enable_prefix_caching=False, **engine))
        loads[f"batchgen_merged{i}"] = t
        merged.append(llm)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(),
                                   paths[0], adapter_name="a0").eval()
    for i in range(1, NUM_ADAPTERS):
        hf.load_adapter(paths[i], adapter_name=f"a{i}")
    return multi, merged, hf, loads


def _result(args: Any, machine: dict, num_prompts: int, times: dict[str, list[float]], loads: dict[str, float],
            agree: str) -> dict:
    tokens = num_prompts * NUM_ADAPTERS * args.max_tokens
    best = {k: min(v) for k, v in times.items()}
    return {
        "machine": machine, "note": "shared 2-core machine under load from other jobs: figures are indicative",
        "workload": {"prompts": num_prompts, "adapters": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS,
                     "max_tokens": args.max_tokens, "generated_tokens": tokens, "threads": args.threads},
        "times_s": times, "load_s": loads,
        "generated_tokens_per_s": {k: tokens / v for k, v in best.items()},
        "ratios": {"multi_lora_vs_merged_one": best["batchgen_merged_one"] / best["batchgen_multi_lora"],
                   "multi_lora_vs_merged_sequential": best["batchgen_merged_sequential"] / best["batchgen_multi_lora"],
                   "multi_lora_vs_hf_peft": best["hf_peft"] / best["batchgen_multi_lora"],
                   **({"multi_lora_vs_vllm_multi_lora": best["vllm_multi_lora"] / best["batchgen_multi_lora"]}
                      if "vllm_multi_lora" in best else {})},
        "greedy_rows_equal_to_merged": agree,
    }


def _hf_loop(model: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """HF generate over W32 (left-padded static batch) under each adapter in turn."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        for i in range(NUM_ADAPTERS):
            model.set_adapter(f"a{i}")
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0)


def _plot(result: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    speeds = result["generated_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(speeds), list(speeds.values()))
    ax.set_xlabel("generated tokens/s (best repeat)")
    w = result["workload"]
    ax.set_title(f"W{w['prompts']} x {w['adapters']} LoRA adapters (rank {w['rank']}), {w['threads']} thread(s), shared machine",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lora.png", dpi=100)
    plt.close(fig)
