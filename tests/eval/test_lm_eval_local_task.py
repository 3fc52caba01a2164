"""The offline example of docs/evaluation.md: ``batchgen lm-eval run`` on the local task that
ships in ``configs/lm_eval_tasks`` (lm-eval's ``--include_path``), with the hub unreachable
(``HF_HUB_OFFLINE=1``), on a tiny random llama.

Oracle: lm-eval's own ``acc`` and ``acc_norm`` of the run against the logged samples'
loglikelihoods, read with batchgen's rules (``chosen``, and ``accuracy_norm``'s
:func:`~batchgen.plugins.scoring_metrics.normalized_choice`: length in characters). Two of the
task's choices are not ASCII (``Brasília``, ``São Paulo``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason='the lm-eval backend needs: pip install "batchgen[lm-eval]"')

TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def tiny_llama(shared_tiny_model) -> str:
    return shared_tiny_model("llama")


def test_the_shipped_local_task_runs_offline(tiny_llama: str, tmp_path: Path, monkeypatch) -> None:
    from batchgen.cli import main
    from batchgen.plugins.scoring_metrics import normalized_choice

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "results"
    status = main(["lm-eval", "run", "--model", "batchgen",
                   "--model_args", f"pretrained={tiny_llama},dtype=float32,max_length=64,num_threads=1",
                   "--tasks", "batchgen_capitals", "--include_path", str(TASKS),
                   "--device", "cpu", "--log_samples", "--output_path", str(out)])
    assert status == 0
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]["batchgen_capitals"]
    samples = [json.loads(line) for path in out.rglob("samples_batchgen_capitals_*.jsonl")
               for line in path.read_text(encoding="utf-8").splitlines()]
    rows = [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(samples) == len(rows) == 8
    hits, norm_hits = 0, 0
    for sample in samples:
        row = rows[sample["doc_id"]]
        lls = [float(resp[0][0]) for resp in sample["resps"]]
        hits += max(range(len(lls)), key=lambda i: lls[i]) == row["answer"]
        choices = [{"text": text, "logprob": lp} for text, lp in zip(row["choices"], lls)]
        norm_hits += normalized_choice(choices) == row["answer"]
    assert results["acc,none"] == pytest.approx(hits / len(rows))
    assert results["acc_norm,none"] == pytest.approx(norm_hits / len(rows))


def test_a_hub_task_offline_is_one_error_line(monkeypatch, capsys) -> None:
    """What the docs promise when the hub cannot be reached: ``datasets``' ConnectionError as one
    line that points to a local task, exit status 1 (lm-eval's CLI stands in, raising it)."""
    import lm_eval.__main__

    from batchgen.cli import main

    def offline() -> None:
        raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", offline)
    assert main(["lm-eval", "run", "--model", "batchgen", "--tasks", "arc_easy"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Couldn't reach 'allenai/ai2_arc' on the Hub" in err[0] and "--include_path" in err[0]
