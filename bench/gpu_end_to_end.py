"""The GPU check's two engine stages (run by ``bench/gpu_check.py``), on models built there.

``end_to_end``  SmolLM2-135M's config with seeded random weights (:mod:`bench.gpu_models`),
                the engine on the ``cuda`` attention backend against HF ``generate`` on the same
                weights and GPU: greedy, beam search of width 4 and n=4 seeded sampling, in
                float16 and bfloat16, with KV blocks of 16 and 32 tokens. Greedy passes when
                every token the engine picks is HF's top-1 or within ``TOP1_MARGIN`` of it (the
                logit gap HF itself sees, teacher-forced on the engine's tokens: two correct
                half-precision programs can break a near-tie differently, after which their
                sequences part); how many sequences are identical is recorded beside it. Beam
                4 passes when the engine's best beam scores, under HF, at least HF's best beam
                less the same margin per token. Sampling passes when a rerun with the same
                seeds repeats every token and the engine's reported log-probability of each
                sampled token is within ``LOGPROB_TOL`` of HF's, teacher-forced.
``throughput``  a 1B model of Llama-3.2-1B's shape (random weights, bfloat16): generated
                tokens/s of batchgen against HF ``generate`` (one left-padded batch) and HF's
                continuous batching (``generate_batch``), W32 and W256, ``MAX_TOKENS`` each
                with EOS ignored, same GPU, one process, the peers one after the other. There
                is no vLLM on the GPU machine (not in its image; its wheels are far over what a
                call carries), so no vLLM figures.

Both stages stop with :func:`bench.gpu_common.gpu_point` before their first CUDA call when there
is no GPU (the dry run); ``DEVICE``, ``ATTENTION_BACKEND`` and ``MODEL_OVERRIDES`` let the tests
run the same code on the CPU with a shrunk model.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_common import gpu_point

DEVICE = "cuda"
ATTENTION_BACKEND = "cuda"
MODEL_OVERRIDES: dict[str, Any] = {}  # the tests shrink both models
E2E_MODEL, THROUGHPUT_MODEL = "smollm2-135m", "llama-3.2-1b-shape"
E2E_DTYPES = ("float16", "bfloat16")
E2E_BLOCK_SIZES = (16, 32)
BEAM_PROMPTS, BEAM_TOKENS = 2, 12
# Logit units (the model's logits spread over about +-15): how far HF's logit of the engine's
# greedy token may trail HF's best, and how far the log-probabilities may differ.
TOP1_MARGIN = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.4}
LOGPROB_TOL = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.4}
MAX_TOKENS = 64
WORKLOADS = ("W32", "W256")
REPEATS = 2
EOS = 2  # SmolLM2's <|im_end|>, the carried tokenizer's


def _sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def _release() -> None:
    """Give the memory of a deleted engine or model back before the next one loads."""
    import gc

    import torch

    gc.collect()
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def _scores(model, prompt: list[int], tokens: list[int]):
    """HF's float32 log-softmax and logits at each of ``tokens``, teacher-forced."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens], device=DEVICE)
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
    return logits.log_softmax(-1), logits


def _strip(row: list[int]) -> list[int]:
    while row and row[-1] == EOS:
        row = row[:-1]
    return row


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts:
            row = model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=EOS, eos_token_id=EOS)[0, len(p):].tolist()
            out.append(_strip(row))
    return out


def hf_beam(model, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    import torch

    with torch.inference_mode():
        rows = model.generate(torch.tensor([prompt], device=DEVICE), num_beams=width, num_return_sequences=width,
                              do_sample=False, max_new_tokens=max_tokens, pad_token_id=EOS,
                              eos_token_id=EOS)[:, len(prompt):].tolist()
    return [_strip(r) for r in rows]


def compare_greedy(model, prompts, ours: list[list[int]], theirs: list[list[int]], margin: float) -> dict[str, Any]:
    """Identical sequences, and the largest gap between HF's best logit and its logit of the
    engine's token over every position the engine generated."""
    gaps = []
    for p, toks in zip(prompts, ours):
        if toks:
            _lp, logits = _scores(model, p, toks)
            chosen = logits.gather(1, _index(toks, logits)).squeeze(1)
            gaps.append(float((logits.max(-1).values - chosen).max()))
    worst = max(gaps, default=0.0)
    return {"identical": sum(a == b for a, b in zip(ours, theirs)), "prompts": len(prompts),
            "max_top1_gap": worst, "margin": margin, "passed": worst <= margin}


def _index(tokens: list[int], like):
    import torch

    return torch.tensor(tokens, device=like.device).unsqueeze(1)


def _hf_logprob(model, prompt: list[int], tokens: list[int]) -> float:
    if not tokens:
        return 0.0
    lp, _ = _scores(model, prompt, tokens)
    return float(lp.gather(1, _index(tokens, lp)).sum())


def compare_beam(model, prompts, ours: list[list[list[int]]], theirs: list[list[list[int]]],
                 margin: float) -> dict[str, Any]:
    """Identical beam sets, and the engine's best beam scored by HF against HF's best beam."""
    shortfall = []
    for p, a, b in zip(prompts, ours, theirs):
        mine = max(_hf_logprob(model, p, t) for t in a)
        best = max(_hf_logprob(model, p, t) for t in b)
        shortfall.append((best - mine) / max(1, len(b[0])))
    worst = max(shortfall, default=0.0)
    return {"identical": sum(a == b for a, b in zip(ours, theirs)), "prompts": len(prompts),
            "max_shortfall_per_token": worst, "margin": margin, "passed": worst <= margin}


def compare_sampled(model, prompts, first: list, second: list, tol: float) -> dict[str, Any]:
    """Seeded reruns repeat; the engine's log-probabilities of its sampled tokens against HF's."""
    diffs = []
    for p, out in zip(prompts, first):
        for completion in out.outputs:
            toks = list(completion.token_ids)
            if not toks:
                continue
            lp, _ = _scores(model, p, toks)
            hf = lp.gather(1, _index(toks, lp)).squeeze(1).tolist()
            mine = [entry[t] for entry, t in zip(completion.logprobs, toks)]
            diffs += [abs(a - b) for a, b in zip(mine, hf)]
    tokens = lambda outs: [[list(c.token_ids) for c in o.outputs] for o in outs]  # noqa: E731
    repeat = tokens(first) == tokens(second)
    distinct = sum(len({tuple(t) for t in row}) for row in tokens(first))
    worst = max(diffs, default=0.0)
    return {"seeded_rerun_identical": repeat, "distinct_completions": distinct,
            "completions": sum(len(o.outputs) for o in first), "max_logprob_diff": worst, "tol": tol,
            "passed": repeat and worst <= tol}


def stage_end_to_end(stage, args, env: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from batchgen import LLM, BeamSearchParams, SamplingParams
    from bench.gpu_models import build
    from bench.workload import w32_prompts

    d = stage.data
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_e2e_"))
    t = time.perf_counter()
    build(E2E_MODEL, folder, seed=0, overrides=MODEL_OVERRIDES)  # on the CPU: the same weights everywhere
    d.update(model=E2E_MODEL, weights="random, seed 0 (bench/gpu_models)", build_s=time.perf_counter() - t)
    prompts = w32_prompts()[:args.prompts]
    n_tokens = args.max_tokens
    rows: list[dict[str, Any]] = []
    d["runs"] = rows
    stage.save()
    gpu_point(f"loading the model onto {DEVICE}", DEVICE)
    for dtype in E2E_DTYPES:
        if stage.left() < 20:
            rows.append({"dtype": dtype, "skipped": "time budget"})
            continue
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(DEVICE).eval()
        want_greedy = hf_greedy(hf, prompts, n_tokens)
        want_beam = [hf_beam(hf, p, 4, BEAM_TOKENS) for p in prompts[:BEAM_PROMPTS]]
        for block in E2E_BLOCK_SIZES:
            if stage.left() < 12:
                rows.append({"dtype": dtype, "block_size": block, "skipped": "time budget"})
                continue
            row: dict[str, Any] = {"dtype": dtype, "block_size": block}
            rows.append(row)
            llm = LLM(model=str(folder), dtype=dtype, device=DEVICE, attention_backend=ATTENTION_BACKEND,
                      block_size=block, seed=0, kv_cache_memory=2 * 2**30)
            row["attention_backend"] = llm.runner.attention_backend
            greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_tokens))
            row["greedy"] = compare_greedy(hf, prompts, [list(o.outputs[0].token_ids) for o in greedy],
                                           want_greedy, TOP1_MARGIN[dtype])
            beams = llm.generate(prompts[:BEAM_PROMPTS], BeamSearchParams(beam_width=4, max_tokens=BEAM_TOKENS))
            row["beam4"] = compare_beam(hf, prompts[:BEAM_PROMPTS],
                                        [[list(c.token_ids) for c in o.outputs] for o in beams], want_beam,
                                        TOP1_MARGIN[dtype])
            sampling = [SamplingParams(n=4, temperature=1.0, seed=1000 + i, max_tokens=n_tokens, logprobs=0)
                        for i in range(len(prompts))]
            first = llm.generate(prompts, sampling)
            second = llm.generate(prompts, sampling)
            row["n4_seeded"] = compare_sampled(hf, prompts, first, second, LOGPROB_TOL[dtype])
            row["passed"] = (row["attention_backend"] == ATTENTION_BACKEND
                             and all(row[k]["passed"] for k in ("greedy", "beam4", "n4_seeded")))
            del llm
            _release()
            stage.save()
        del hf
        _release()
    ran = [r for r in rows if "passed" in r]
    d["passed"] = len(ran) == len(E2E_DTYPES) * len(E2E_BLOCK_SIZES) and all(r["passed"] for r in ran)
    d["summary"] = "; ".join(
        f"{r['dtype']}/b{r['block_size']}: greedy {r['greedy']['identical']}/{r['greedy']['prompts']} identical "
        f"(gap {r['greedy']['max_top1_gap']:.3f}), beam {r['beam4']['identical']}/{r['beam4']['prompts']}, "
        f"n4 {'ok' if r['n4_seeded']['passed'] else 'FAIL'}" for r in ran) or "nothing ran"


def _time_peer(stage, fn, repeats: int) -> dict[str, Any]:
    """Run ``fn()`` (returns generated tokens) ``repeats`` times while time is left."""
    times, tokens = [], 0
    for i in range(repeats):
        if i and stage.left() < 15:
            break
        _sync()
        t = time.perf_counter()
        tokens = fn()
        _sync()
        times.append(time.perf_counter() - t)
    best = sorted(times)[len(times) // 2]
    return {"tokens": tokens, "seconds": times, "tok_per_s": tokens / best,
            "tok_per_s_range": [tokens / max(times), tokens / min(times)]}


def _left_padded(prompts: list[list[int]]):
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def _recorder(stage, rows: list[dict[str, Any]]) -> Callable[[str, str, Callable[[], int]], None]:
    """``record(peer, workload, fn)``: one row of ``rows`` for ``fn`` timed (or why not), saved."""
    def record(peer: str, name: str, fn: Callable[[], int]) -> None:
        if stage.left() < 15:
            rows.append({"peer": peer, "workload": name, "skipped": "time budget"})
            return
        try:
            rows.append({"peer": peer, "workload": name, **_time_peer(stage, fn, REPEATS)})
        except Exception as exc:  # noqa: BLE001 - one peer's failure is recorded, the others run
            rows.append({"peer": peer, "workload": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
        stage.save()
    return record


def _batchgen_rows(record, data: dict[str, Any], folder: Path, workloads: dict[str, list[list[int]]]) -> None:
    """batchgen's rows: greedy with EOS ignored on each workload, after a warm-up (its attention
    backend into ``data``). The engine lives as long as the call; the caller releases its memory."""
    from batchgen import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="bfloat16", device=DEVICE, attention_backend=ATTENTION_BACKEND, seed=0,
              kv_cache_memory=16 * 2**30)  # W256 needs under 1 GiB; the HF peers get the rest
    data["attention_backend"] = llm.runner.attention_backend
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(workloads["W32"][:4], SamplingParams(temperature=0.0, max_tokens=4))  # kernels built, warm
    for name in WORKLOADS:
        record("batchgen", name, lambda p=workloads[name]: sum(len(o.outputs[0].token_ids)
                                                               for o in llm.generate(p, params)))


def _hf_rows(record, rows: list[dict[str, Any]], folder: Path, workloads: dict[str, list[list[int]]]) -> None:
    """HF's rows: ``generate`` on left-padded batches, and ``generate_batch`` where this
    transformers has it (continuous batching), MAX_TOKENS new tokens each. The model lives as
    long as the call; the caller releases its memory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()

    def hf_generate(prompts: list[list[int]]) -> int:
        ids, mask = _left_padded(prompts)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=EOS)
        return (out.shape[1] - ids.shape[1]) * len(prompts)

    hf_generate(workloads["W32"][:4])  # warm
    for name in WORKLOADS:
        record("hf_generate", name, lambda p=workloads[name]: hf_generate(p))
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=EOS, pad_token_id=EOS)
    if not hasattr(model, "generate_batch"):
        rows.append({"peer": "hf_generate_batch", "error": "this transformers has no generate_batch"})
    else:
        for name in WORKLOADS:
            record("hf_generate_batch", name, lambda p=workloads[name]: sum(
                len(r.generated_tokens) for r in model.generate_batch(inputs=p, generation_config=config).values()))


def stage_throughput(stage, args, env: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from bench.gpu_models import build, num_parameters, write_tokenizer
    from bench.workload import w256_prompts

    d = stage.data
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_tput_"))
    write_tokenizer(folder)
    w256 = w256_prompts(AutoTokenizer.from_pretrained(folder))
    workloads = {"W32": w256[:32], "W256": w256}
    d.update(model=THROUGHPUT_MODEL, parameters=num_parameters(THROUGHPUT_MODEL, MODEL_OVERRIDES),
             dtype="bfloat16", max_tokens=MAX_TOKENS, ignore_eos=True, weights="random, seed 0",
             vllm=("installed" if importlib.util.find_spec("vllm") else
                   "not on the GPU machine's image and too large to carry: no vLLM figures"))
    rows: list[dict[str, Any]] = []
    d["rows"] = rows
    stage.save()
    gpu_point(f"drawing the {THROUGHPUT_MODEL} weights on {DEVICE}", DEVICE)
    t = time.perf_counter()
    build(THROUGHPUT_MODEL, folder, dtype="bfloat16", device=DEVICE, seed=0, overrides=MODEL_OVERRIDES)
    d["build_s"] = time.perf_counter() - t
    record = _recorder(stage, rows)
    _batchgen_rows(record, d, folder, workloads)
    _release()  # the engine went with the call's frame
    _hf_rows(record, rows, folder, workloads)
    _release()
    d["ratios"] = ratios(rows)
    ok = [r for r in rows if "tok_per_s" in r]
    d["passed"] = len(ok) == len(rows) and bool(ok)
    d["summary"] = ", ".join(f"{k} {v:.2f}x" for k, v in d["ratios"].items()) or "no ratios"


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """batchgen's tokens/s over each HF peer's, per workload (``W256 vs hf_generate``: ...)."""
    rate = {(r["peer"], r["workload"]): r["tok_per_s"] for r in rows if "tok_per_s" in r}
    out = {}
    for (peer, workload), value in rate.items():
        ours = rate.get(("batchgen", workload))
        if peer != "batchgen" and ours:
            out[f"{workload} vs {peer}"] = ours / value
    return out
