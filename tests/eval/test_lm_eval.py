"""lm-eval's model ``batchgen`` against lm-eval's model ``hf`` on the real SmolLM2 in fp32.

The local tasks of ``tests/eval/tasks`` (a 3-shot multiple-choice task of 12 questions with 2 to
5 choices, one continuation starting mid-word; a ``generate_until`` task; a rolling-perplexity
task) run through ``simple_evaluate`` with both models, ``max_length`` 128 so that the rolling
texts take several windows. The ``hf`` model reads the same fp32 folder that batchgen converts
the embedded GGUF into.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason='the lm-eval backend needs: pip install "batchgen[lm-eval]"')

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "tasks"
TASK_NAMES = ["batchgen_mc", "batchgen_gen", "batchgen_ppl"]
MAX_LENGTH = 128
METRICS = ("acc", "acc_norm", "exact_match", "word_perplexity", "byte_perplexity", "bits_per_byte")


def _summary(results: dict) -> dict:
    """The JSON-able part of simple_evaluate's answer: the metrics and each sample's responses."""
    metrics = {task: {key.split(",")[0]: value for key, value in results["results"][task].items()
                      if key.split(",")[0] in METRICS and not key.endswith("_stderr")}
               for task in TASK_NAMES}
    samples = {task: {str(s["doc_id"]): json.loads(json.dumps(s["filtered_resps"])) for s in results["samples"][task]}
               for task in TASK_NAMES}
    arguments = {str(s["doc_id"]): [list(a) for a in s["arguments"]] for s in results["samples"]["batchgen_mc"]}
    return {"metrics": metrics, "samples": samples, "mc_arguments": arguments}


def _evaluate(model, model_args: str | None = None, **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=TASK_NAMES,
                              task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
                              device="cpu", **kwargs)
    return _summary(results)


def _task_files_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(TASKS.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def hf_summary(smollm2_path: str, oracle_cache) -> dict:
    import lm_eval

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = ["lm-eval-hf", 2, lm_eval.__version__, _task_files_digest(), MAX_LENGTH, "float32"]
    return oracle_cache(key, lambda: _evaluate(
        "hf", f"pretrained={smollm2_path},dtype=float32,max_length={MAX_LENGTH}", batch_size=8))


@pytest.fixture(scope="module")
def batchgen_summary(smollm2_path: str) -> dict:
    from batchgen.integrations.lm_eval import BatchgenLM

    lm = BatchgenLM(pretrained=smollm2_path, dtype="float32", max_length=MAX_LENGTH, block_size=16)
    return _evaluate(lm)


def _tolerance(num_tokens: int) -> float:
    """1e-4 nats for a choice of up to 5 tokens, 2e-5 per token beyond. HF's own fp32
    ``log_softmax`` is that far from the same logits' float64 one: on this task's 13- and
    18-token choices the two differ by 1.0e-4 and 1.5e-4, so no fp32 pair of implementations
    meets a flat 1e-4 on sums of 20 tokens."""
    return max(1e-4, 2e-5 * num_tokens)


def test_multiple_choice_acc_and_loglikelihoods_equal_hf(hf_summary, batchgen_summary, smollm2_tokenizer):
    from batchgen.engine.loglikelihood import encode_pair

    assert batchgen_summary["metrics"]["batchgen_mc"] == hf_summary["metrics"]["batchgen_mc"]
    ours, theirs = batchgen_summary["samples"]["batchgen_mc"], hf_summary["samples"]["batchgen_mc"]
    assert ours.keys() == theirs.keys() and len(ours) == 12
    assert batchgen_summary["mc_arguments"] == hf_summary["mc_arguments"]  # the same few-shot requests
    for doc_id, choices in theirs.items():
        assert len(ours[doc_id]) == len(choices)
        for (lp, greedy), (ref_lp, ref_greedy), (ctx, cont) in zip(ours[doc_id], choices,
                                                                  hf_summary["mc_arguments"][doc_id]):
            num_tokens = len(encode_pair(smollm2_tokenizer, ctx, cont)[1])
            assert abs(lp - ref_lp) <= _tolerance(num_tokens), (doc_id, num_tokens, lp, ref_lp)
            assert greedy == ref_greedy, doc_id


def test_generate_until_text_equals_hf_greedy(hf_summary, batchgen_summary):
    ours, theirs = batchgen_summary["samples"]["batchgen_gen"], hf_summary["samples"]["batchgen_gen"]
    assert ours == theirs
    assert all(text[0].strip() for text in theirs.values())  # every question gets an answer
    assert batchgen_summary["metrics"]["batchgen_gen"] == hf_summary["metrics"]["batchgen_gen"]


def test_rolling_loglikelihood_equals_hf_windows(hf_summary, batchgen_summary):
    ours, theirs = batchgen_summary["samples"]["batchgen_ppl"], hf_summary["samples"]["batchgen_ppl"]
    assert ours.keys() == theirs.keys()
    for doc_id, (ref,) in theirs.items():
        # a sum over up to ~130 token logprobs, each within fp32 rounding of HF's
        assert abs(ours[doc_id][0] - ref) <= 1e-4 * max(1.0, abs(ref) / 10), (doc_id, ours[doc_id], ref)
    for metric, value in hf_summary["metrics"]["batchgen_ppl"].items():
        assert batchgen_summary["metrics"]["batchgen_ppl"][metric] == pytest.approx(value, rel=1e-5), metric


def test_batchgen_lm_eval_command_runs_lm_evals_cli(smollm2_path: str, hf_summary, tmp_path: Path):
    """``batchgen lm-eval run --model batchgen ...`` (lm-eval's own CLI) writes lm-eval's results."""
    from batchgen.cli import main

    out = tmp_path / "results"
    status = main(["lm-eval", "run", "--model", "batchgen",
                   "--model_args", f"pretrained={smollm2_path},dtype=float32,max_length={MAX_LENGTH}",
                   "--tasks", "batchgen_mc", "--include_path", str(TASKS), "--limit", "3",
                   "--device", "cpu", "--log_samples", "--output_path", str(out)])
    assert status == 0
    files = sorted(out.rglob("results_*.json"))
    assert files, f"no results file under {out}"
    results = json.loads(files[-1].read_text())
    expected = sum(1.0 for doc_id in ("0", "1", "2")
                   if max(range(len(choices := hf_summary["samples"]["batchgen_mc"][doc_id])),
                          key=lambda i: choices[i][0]) == _answers()[int(doc_id)]) / 3
    assert results["results"]["batchgen_mc"]["acc,none"] == pytest.approx(expected)


def _answers() -> list[int]:
    rows = [json.loads(line) for line in (TASKS / "mc.jsonl").read_text().splitlines() if line.strip()]
    return [r["answer"] for r in rows if r["split"] == "test"]
