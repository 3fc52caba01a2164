"""YAML scoring jobs on the tiny model: ``generation.mode: loglikelihood`` and ``perplexity``.

Oracles: ``LLM.loglikelihood`` / ``LLM.loglikelihood_rolling`` on the same pairs and texts
(the job must give the API's numbers), an HF ``log_softmax`` gather of the tiny model for the
choices' logprobs, and accuracy recomputed from the records.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from batchgen.config import ConfigError, load_config, plugin_modules
from batchgen.plugins import load_registry
from batchgen.run.execute import execute
from batchgen.run.plan import plan

QUESTIONS = [
    {"qid": f"m{i}", "question": f"What is {i} plus {i}?", "options": [str(2 * i), str(2 * i + 1), "blue", "seven apples"][: 2 + i % 3],
     "label": i % 2}
    for i in range(8)
]
TEXTS = [
    {"tid": "t0", "text": "The quick brown fox jumps over the lazy dog."},
    {"tid": "t1", "text": " ".join(f"word{i} and the number {i * 7}," for i in range(60))},  # > 256 tokens: windows
    {"tid": "t2", "text": "Hello world"},
]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(path: Path, llm: Any, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    registry = load_registry(plugin_modules(path, overrides))
    config = load_config(path, overrides, registry=registry)
    summary = execute(plan(config, registry, config_path=str(path)), quiet=True, llm=llm)
    return summary, _read(Path(config.output.path))


def _scoring_job(job_config: Any, generation: dict[str, Any], **sections: Any) -> Path:
    """The tiny job of ``job_config`` with exactly these sections (and no metrics)."""
    import yaml

    path = job_config(metrics=[])
    config = yaml.safe_load(path.read_text())
    config |= sections | {"generation": generation}  # whole sections, not merged
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def mc_job(tmp_path: Path, job_config):
    """Factory of a loglikelihood job over ``rows`` (default :data:`QUESTIONS`)."""

    def make(rows: list[dict[str, Any]] = QUESTIONS, **generation: Any) -> Path:
        data = _write_jsonl(tmp_path / "mc.jsonl", rows)
        return _scoring_job(
            job_config, {"mode": "loglikelihood", "choices": "options", "answer": "label", **generation},
            data={"source": str(data), "id_column": "qid"},
            prompt={"template": "Question: {{ question }}\nAnswer:", "chat_template": False},
        )

    return make


def _hf_loglikelihood(model: Any, context: list[int], continuation: list[int]) -> float:
    import torch

    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum())


def test_loglikelihood_job_equals_api_and_hf(mc_job, tiny_llm, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    from batchgen.engine.loglikelihood import encode_pair

    summary, records = _run(mc_job(), tiny_llm)
    assert summary["status"] == "completed" and summary["records"]["ok"] == len(QUESTIONS)
    by_id = {r["id"]: r for r in records}
    pairs, where = [], []
    for row in QUESTIONS:
        context = f"Question: {row['question']}\nAnswer:"
        for j, choice in enumerate(row["options"]):
            pairs.append((context, " " + choice))
            where.append((row["qid"], j))
    api = tiny_llm.loglikelihood(pairs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype="float32").eval()
    for (qid, j), (context, continuation), (logprob, greedy) in zip(where, pairs, api):
        entry = by_id[qid]["choices"][j]
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-5) and entry["is_greedy"] == greedy
        ctx, cont = encode_pair(tiny_llm.tokenizer, context, continuation)
        assert entry["num_tokens"] == len(cont)
        assert entry["logprob"] == pytest.approx(_hf_loglikelihood(hf, ctx, cont), abs=1e-3)
    # chosen / chosen_norm recomputed from the logprobs; accuracy from the records.
    for row in QUESTIONS:
        record = by_id[row["qid"]]
        lps = [c["logprob"] for c in record["choices"]]
        assert record["chosen"] == max(range(len(lps)), key=lambda i: lps[i])
        norm = [lp / len(c) for lp, c in zip(lps, row["options"])]  # lm-eval's acc_norm: characters
        assert record["chosen_norm"] == max(range(len(norm)), key=lambda i: norm[i])
        assert record["answer"] == row["label"] and record["prompt"].startswith("Question:")
    acc = sum(r["chosen"] == r["answer"] for r in records) / len(records)
    acc_norm = sum(r["chosen_norm"] == r["answer"] for r in records) / len(records)
    assert summary["metrics"]["accuracy"] == {"acc": pytest.approx(acc)}
    assert summary["metrics"]["accuracy_norm"] == {"acc_norm": pytest.approx(acc_norm)}
    # The choices of a row shared the context's blocks: some prompt tokens came from the cache.
    assert summary["throughput"]["prefill_tokens"] < summary["throughput"]["prompt_tokens"]


def test_choices_as_templates_and_answer_as_text(mc_job, tiny_llm) -> None:
    rows = [{"qid": f"c{i}", "question": f"Is {i} even?", "right": ["yes", "no"][i % 2]} for i in range(4)]
    _, records = _run(mc_job(rows, choices=["yes", "no"]), tiny_llm, "generation.answer=right")
    for row, record in zip(rows, sorted(records, key=lambda r: r["index"])):
        assert [c["text"] for c in record["choices"]] == ["yes", "no"]
        assert record["answer"] == ["yes", "no"].index(row["right"])
    api = tiny_llm.loglikelihood([("Question: Is 0 even?\nAnswer:", " yes"), ("Question: Is 0 even?\nAnswer:", " no")])
    first = next(r for r in records if r["id"] == "c0")
    assert [c["logprob"] for c in first["choices"]] == pytest.approx([lp for lp, _ in api], abs=1e-5)


def test_perplexity_job_equals_loglikelihood_rolling(job_config, tiny_llm, tmp_path) -> None:
    data = _write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    path = _scoring_job(job_config, {"mode": "perplexity"}, data={"source": str(data), "id_column": "tid"},
                        prompt={"column": "text"})  # no chat template by default, though the tokenizer has one
    summary, records = _run(path, tiny_llm)
    by_id = {r["id"]: r for r in records}
    rolling = tiny_llm.loglikelihood_rolling([t["text"] for t in TEXTS])
    for row, expected in zip(TEXTS, rolling):
        record = by_id[row["tid"]]
        assert record["error"] is None and record["loglikelihood"] == pytest.approx(expected, abs=1e-4)
        assert record["num_words"] == len(re.split(r"\s+", row["text"]))
        assert record["num_bytes"] == len(row["text"].encode("utf-8"))
        assert record["num_tokens"] == len(tiny_llm.tokenizer.encode(row["text"]))
    assert by_id["t1"]["num_windows"] > 1 and by_id["t0"]["num_windows"] == 1
    ll = sum(rolling)
    words = sum(r["num_words"] for r in records)
    nbytes = sum(r["num_bytes"] for r in records)
    tokens = sum(r["num_tokens"] for r in records)
    got = summary["metrics"]["perplexity"]
    assert got["word_perplexity"] == pytest.approx(math.exp(-ll / words), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(-ll / nbytes), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(-ll / nbytes / math.log(2), rel=1e-5)
    assert got["token_perplexity"] == pytest.approx(math.exp(-ll / tokens), rel=1e-5)


def test_resume_after_a_partial_run_gives_the_same_records(mc_job, tiny_llm) -> None:
    path = mc_job()
    _, full = _run(path, tiny_llm)
    out = Path(load_config(path).output.path)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]))
    summary, resumed = _run(path, tiny_llm, "output.if_exists=resume")
    assert summary["records"]["resumed"] == 3 and summary["records"]["this_run"] == len(QUESTIONS) - 3

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k != "usage"}  # cached tokens depend on what ran before

    assert sorted(map(json.dumps, map(strip, resumed))) == sorted(map(json.dumps, map(strip, full)))
    assert summary["metrics"]["accuracy"]["acc"] == pytest.approx(
        sum(r["chosen"] == r["answer"] for r in full) / len(full))


def test_bad_rows_become_error_records(mc_job, tiny_llm) -> None:
    long_context = "word " * 400  # the tiny model reads 256 positions
    rows = [
        {"qid": "ok", "question": "What is 1 plus 1?", "options": ["2", "3"], "label": 0},
        {"qid": "out_of_range", "question": "What is 2 plus 2?", "options": ["4", "5"], "label": 5},
        {"qid": "no_answer", "question": "What is 3 plus 3?", "options": ["6", "7"]},
        {"qid": "too_long", "question": long_context, "options": ["a", "b"], "label": 1},
    ]
    summary, records = _run(mc_job(rows), tiny_llm)
    by_id = {r["id"]: r for r in records}
    assert by_id["ok"]["error"] is None and len(by_id["ok"]["choices"]) == 2
    assert summary["metric_rows"] == {"accuracy": {"rows": 1, "failed": 3}, "accuracy_norm": {"rows": 1, "failed": 3}}
    assert sum(r["count"] for r in summary["records"]["error_reasons"]) == 3
    assert "answer index 5 is out of range" in by_id["out_of_range"]["error"]
    assert by_id["no_answer"]["error"].startswith("the row has no 'label' field (generation.answer)")
    assert "tokens" in by_id["too_long"]["error"] and "truncate" in by_id["too_long"]["error"]
    assert summary["records"]["error"] == 3 and summary["records"]["ok"] == 1
    # With truncate, the long row is scored: the pair loses its context's first tokens.
    _, records = _run(mc_job(rows, truncate=True), tiny_llm, "output.if_exists=overwrite")
    scored = next(r for r in records if r["id"] == "too_long")
    assert scored["error"] is None
    from batchgen.engine.loglikelihood import encode_pair

    context = f"Question: {long_context}\nAnswer:"
    api = tiny_llm.loglikelihood([(context, " a"), (context, " b")], truncate=True)
    assert [c["logprob"] for c in scored["choices"]] == pytest.approx([lp for lp, _ in api], abs=1e-5)
    assert scored["choices"][0]["num_tokens"] == len(encode_pair(tiny_llm.tokenizer, context, " a")[1])


def test_missing_choices_column_is_a_config_error(mc_job) -> None:
    path = mc_job(choices="nope")
    registry = load_registry(plugin_modules(path, ()))
    with pytest.raises(ConfigError) as info:
        plan(load_config(path, registry=registry), registry, prepare=False)
    assert "generation.choices" in str(info.value) and "'nope'" in str(info.value)


def test_validate_exits_2_on_a_missing_choices_column(mc_job) -> None:
    from batchgen.cli import main

    assert main(["validate", str(mc_job(choices="nope"))]) == 2


def test_run_prints_a_results_table(mc_job, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    path = mc_job()
    assert main(["run", str(path)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(Path(load_config(path).output.summary_file).read_text())
    rows = {name: (value, int(n), int(failed)) for name, value, n, failed
            in re.findall(r"^\| (acc\w*) +\| +([\d.]+) \| +(\d+) \| +(\d+) \|$", captured.out, re.M)}
    assert rows == {"acc": (f"{summary['metrics']['accuracy']['acc']:.4f}", len(QUESTIONS), 0),
                    "acc_norm": (f"{summary['metrics']['accuracy_norm']['acc_norm']:.4f}", len(QUESTIONS), 0)}
    # A scoring job speaks of scoring: rows, and the tokens scored per second (progress, final line, summary).
    scored = sum(r["usage"]["prompt_tokens"] for r in _read(Path(summary["output"])))
    assert f"batchgen: scoring {len(QUESTIONS)} row(s)" in captured.err
    assert f"{len(QUESTIONS)}/{len(QUESTIONS)} rows, {scored:,} tokens scored, " in captured.err
    assert "generating" not in captured.err and "records," not in captured.err
    assert re.search(r"^throughput: [\d.]+ tok/s scored", captured.out, re.M)
    assert summary["throughput"]["scored_tokens"] == scored
    assert summary["throughput"]["scored_tokens_per_s"] == pytest.approx(scored / summary["throughput"]["seconds"])


def test_validate_notes_a_bad_row_and_says_ok(mc_job, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    rows = [dict(QUESTIONS[0]), dict(QUESTIONS[1], label=9)]
    path = str(mc_job(rows))
    assert main(["validate", path, "--max-failed-rows", "1"]) == 0
    out = capsys.readouterr().out
    assert f"note: row id '{rows[1]['qid']}': the answer index 9 is out of range" in out and ": ok (" in out
    # Without the flag a scoring job allows no failed row: validate says so, as the run would.
    assert main(["validate", path]) == 3
    captured = capsys.readouterr()
    assert "the answer index 9 is out of range" in captured.out and ": ok (" not in captured.out
    assert "over --max-failed-rows 0" in captured.err and "exit 3" in captured.err


CAPITALS = [
    {"qid": "cap0", "question": "What is the capital of France?", "options": ["Berlin", "Madrid", "Paris", "Rome"],
     "answer": "Paris"},
    {"qid": "cap1", "question": "What is the capital of Italy?", "options": ["Berlin", "Madrid", "Paris", "Rome"],
     "answer": 3},
    {"qid": "cap2", "question": "What is the capital of Spain?", "options": ["Berlin", "Madrid", "Paris", "Rome"],
     "answer": "Madrid"},
    {"qid": "cap3", "question": "What is the capital of Germany?", "options": ["Berlin", "Madrid", "Paris", "Rome"],
     "answer": "A"},
]


@pytest.fixture
def letters_job(tmp_path: Path, job_config):
    """The issue's job: choices are the letters A-D, and two of four answers hold the option's text."""
    data = _write_jsonl(tmp_path / "capitals.jsonl", [dict(r, answer=str(r["answer"])) for r in CAPITALS])
    return _scoring_job(
        job_config, {"mode": "loglikelihood", "choices": ["A", "B", "C", "D"], "answer": "answer"},
        data={"source": str(data), "id_column": "qid"},
        prompt={"chat_template": False, "template": "{{ question }}\n{% for o in options %}{{ 'ABCD'[loop.index0] }}. "
                "{{ o }}\n{% endfor %}Answer:"})


def test_letter_choices_with_text_answers_fail_loudly(letters_job, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    path = str(letters_job)
    assert main(["validate", path]) == 3  # before the model loads
    captured = capsys.readouterr()
    assert "note: row id 'cap0': the answer 'Paris' is none of the row's choices ('A', 'B', 'C', 'D')" in captured.out
    assert "note: row id 'cap2': the answer 'Madrid'" in captured.out and "2 would fail" in captured.err

    assert main(["run", path]) == 3
    captured = capsys.readouterr()
    final = captured.err.strip().splitlines()[-1]
    assert final.startswith("batchgen: error: 2 of 4 rows failed; most often (2 rows): id 'cap0': the answer 'Paris'")
    assert "over --max-failed-rows 0" in final
    table = {name: (int(n), int(failed)) for name, n, failed
             in re.findall(r"^\| (acc\w*) +\| +[\d.]+ \| +(\d+) \| +(\d+) \|$", captured.out, re.M)}
    assert table == {"acc": (2, 2), "acc_norm": (2, 2)}
    summary = json.loads(Path(load_config(letters_job).output.summary_file).read_text())
    assert summary["metric_rows"]["accuracy"] == {"rows": 2, "failed": 2}
    assert summary["records"]["error_reasons"][0]["count"] == 2

    # Accepted explicitly: exit 0, and the final word still says what was left out.
    assert main(["run", path, "--overwrite", "--max-failed-rows", "2"]) == 0
    assert "2 of 4 rows failed; most often (2 rows)" in capsys.readouterr().err


def test_validate_checks_the_first_20_rows(mc_job, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    rows = [dict(QUESTIONS[i % len(QUESTIONS)], qid=f"r{i}") for i in range(25)]
    rows[17]["label"] = 7  # past the 5 rows a generation job's validate renders
    rows[22]["label"] = 7  # past the 20 checked
    assert main(["validate", str(mc_job(rows))]) == 3
    out = capsys.readouterr().out
    assert "row id 'r17': the answer index 7 is out of range" in out and "'r22'" not in out


def test_a_perplexity_jobs_bad_rows_get_one_rule_at_validate_and_run(job_config, tiny_llm, tmp_path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    rows = [TEXTS[0], {"tid": "null", "text": None}, {"tid": "blank", "text": "   "}]
    data = _write_jsonl(tmp_path / "texts.jsonl", rows)
    path = _scoring_job(job_config, {"mode": "perplexity"}, data={"source": str(data), "id_column": "tid"},
                        prompt={"column": "text"})
    assert main(["validate", str(path)]) == 3
    assert "note: row id 'null': column 'text' is empty (null) in this row" in capsys.readouterr().out
    assert main(["validate", str(path), "--max-failed-rows", "1"]) == 0
    summary, records = _run(path, tiny_llm)
    by_id = {r["id"]: r for r in records}
    assert by_id["null"]["error"] == "column 'text' is empty (null) in this row"
    # Whitespace that tokenizes is scored, as LLM.loglikelihood_rolling scores it.
    assert by_id["blank"]["error"] is None
    assert by_id["blank"]["loglikelihood"] == pytest.approx(tiny_llm.loglikelihood_rolling(["   "])[0], abs=1e-5)
    assert summary["metric_rows"]["perplexity"] == {"rows": 2, "failed": 1}
    assert main(["run", str(path), "--overwrite"]) == 3
    assert main(["run", str(path), "--overwrite", "--max-failed-rows", "1"]) == 0


def test_whitespace_choices_are_scored_and_tokenless_ones_refused(mc_job, tiny_llm) -> None:
    rows = [{"qid": "w", "question": "Pick one", "options": ["yes", "  "], "label": 0},
            {"qid": "e", "question": "Pick one", "options": ["yes", ""], "label": 0}]
    _, records = _run(mc_job(rows), tiny_llm)
    by_id = {r["id"]: r for r in records}
    context = "Question: Pick one\nAnswer:"
    api = tiny_llm.loglikelihood([(context, " yes"), (context, "   "), (context, " ")])
    assert [c["logprob"] for c in by_id["w"]["choices"]] == pytest.approx([api[0][0], api[1][0]], abs=1e-5)
    assert [c["logprob"] for c in by_id["e"]["choices"]] == pytest.approx([api[0][0], api[2][0]], abs=1e-5)
    # With no delimiter an empty choice has no tokens at all: refused, as the API refuses "".
    _, records = _run(mc_job(rows, target_delimiter=""), tiny_llm, "output.if_exists=overwrite")
    assert next(r for r in records if r["id"] == "e")["error"] == "choice 1 is empty (nothing to score)"
    with pytest.raises(ValueError):
        tiny_llm.loglikelihood([(context, "")])


def test_accuracy_norm_divides_by_characters_as_lm_eval() -> None:
    """lm-eval's acc_norm: ``argmax(lls / [len(choice) for choice in choices])``, ``len`` of the
    text in characters. On these non-ASCII choices UTF-8 bytes pick the other one."""
    import numpy as np

    from batchgen.plugins.scoring_metrics import normalized_choice, scoring_metric_specs

    texts, lls = ["日本語", "tea now"], [-6.0, -7.0]
    lm_eval_pick = int(np.argmax(np.array(lls) / np.array([float(len(t)) for t in texts])))
    bytes_pick = int(np.argmax(np.array(lls) / np.array([float(len(t.encode())) for t in texts])))
    assert lm_eval_pick != bytes_pick  # the case the fix is about
    choices = [{"text": t, "logprob": lp} for t, lp in zip(texts, lls)]
    assert normalized_choice(choices) == lm_eval_pick
    spec = next(s for s in scoring_metric_specs() if s.name == "accuracy_norm")
    metric = spec.factory(spec.options_model())
    assert metric.score({"choices": choices, "answer": lm_eval_pick}, {}) == {"acc_norm": 1.0}
    assert metric.score({"choices": choices, "answer": bytes_pick}, {}) == {"acc_norm": 0.0}


def test_validate_refuses_a_tokenless_choice_as_run_does(mc_job, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    rows = [{"qid": "e", "question": "Pick one", "options": ["yes", ""], "label": 0}]
    assert main(["validate", str(mc_job(rows, target_delimiter=""))]) == 3
    assert "note: row id 'e': choice 1 is empty (nothing to score)" in capsys.readouterr().out


def test_every_scoring_kind_has_a_scorer_and_owns_its_keys() -> None:
    from batchgen.config import GenerationSection
    from batchgen.config.formats import SCORING_KINDS, scoring_kind
    from batchgen.run.scoring_kinds import SCORERS

    assert set(SCORERS) == set(SCORING_KINDS.values())
    from typing import get_args

    from batchgen.config import GenerationMode

    assert set(SCORING_KINDS) <= set(get_args(GenerationMode))  # the schema accepts every kind's mode
    for mode, kind in SCORING_KINDS.items():
        assert SCORERS[kind].kind is kind and scoring_kind(GenerationSection(mode=mode, choices=["a"]) if kind.keys
                                                           else GenerationSection(mode=mode)) is kind
        for key in kind.keys:
            for other in ("greedy", *(m for m in SCORING_KINDS if m != mode)):
                with pytest.raises(ValueError, match=f"'{key}' applies to mode '{mode}'"):
                    GenerationSection(mode=other, **{key: {"choices": ["x"], "answer": "y", "target_delimiter": "",
                                                           "truncate": True}[key]})
    assert scoring_kind(GenerationSection(mode="greedy")) is None
