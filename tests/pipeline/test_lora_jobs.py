"""YAML jobs swept over LoRA adapters (``model.adapters``, ``generation.adapters``): every row
under each adapter and the base in one run, records tagged with ``adapter`` and equal to the
Python API's outputs under the same LoRARequest, resume per (row, adapter), metrics per adapter
(``acc`` of a scoring job included), and a bad adapter failing only its own rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("peft")

from batchgen import LLM, LoRARequest, SamplingParams  # noqa: E402
from batchgen.config import ConfigError, load_config, plugin_modules  # noqa: E402
from batchgen.plugins import load_registry  # noqa: E402
from batchgen.run.execute import execute  # noqa: E402
from batchgen.run.plan import plan  # noqa: E402

from pipeline_rows import QA_ROWS, TINY_ENGINE  # noqa: E402
from lora_adapters import ALL, save_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory) -> Path:
    """Two checkpoint folders of random adapters on the tiny llama."""
    root = tmp_path_factory.mktemp("lora_ckpts")
    save_adapter(tiny_llama, root / "checkpoint-1", 8, ["q_proj", "v_proj"], seed=1, std=0.2)
    save_adapter(tiny_llama, root / "checkpoint-2", 16, ALL, rslora=True, seed=2, std=0.2)
    return root


@pytest.fixture(scope="module")
def lora_llm(tiny_llama: str) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", device="cpu", block_size=TINY_ENGINE["block_size"],
               kv_cache_memory=16 * 2**20, max_num_seqs=TINY_ENGINE["max_num_seqs"], enable_lora=True,
               max_loras=8, max_lora_rank=64)


def _run(path: Path, llm: Any, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    registry = load_registry(plugin_modules(path, overrides))
    config = load_config(path, overrides, registry=registry)
    summary = execute(plan(config, registry, config_path=str(path)), quiet=True, llm=llm)
    records = [json.loads(line) for line in Path(config.output.path).read_text().splitlines()]
    return summary, records


def _job(job_config: Any, adapters: Path, names: list[str], **sections: Any) -> Path:
    path = job_config(**sections)
    config = yaml.safe_load(path.read_text())
    config["model"]["adapters"] = {"one": str(adapters / "checkpoint-1"), "two": str(adapters / "checkpoint-2"),
                                   "gone": str(adapters / "no-such-checkpoint")}
    config["generation"]["adapters"] = names
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_a_sweep_equals_the_api_per_adapter_and_a_bad_adapter_fails_alone(job_config, adapters, lora_llm) -> None:
    path = _job(job_config, adapters, ["base", "one", "two", "gone"])
    summary, records = _run(path, lora_llm)
    assert summary["status"] == "completed" and len(records) == 4 * len(QA_ROWS)
    by_key = {(r["id"], r["adapter"]): r for r in records}
    assert len(by_key) == len(records)
    prompts = [f"Q: {row['question']}\nA:" for row in QA_ROWS]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    requests = {"base": None, "one": LoRARequest("one", 1, str(adapters / "checkpoint-1")),
                "two": LoRARequest("two", 2, str(adapters / "checkpoint-2"))}
    texts = {}
    for name, request in requests.items():
        outs = lora_llm.generate(prompts, params, lora_request=request)
        texts[name] = [o.outputs[0].text for o in outs]
        for row, text in zip(QA_ROWS, texts[name]):
            record = by_key[(row["qid"], name)]
            assert record["error"] is None and record["generations"][0]["text"] == text
    assert texts["one"] != texts["base"] and texts["two"] != texts["base"]
    for row in QA_ROWS:
        error = by_key[(row["qid"], "gone")]["error"]
        assert "LoRA adapter 'gone'" in error and "no such adapter folder" in error
    by_adapter = summary["metrics_by_adapter"]
    assert set(by_adapter) == {"base", "one", "two", "gone"} and by_adapter["gone"] == {}
    for name in ("base", "one", "two"):
        lengths = [len(by_key[(row["qid"], name)]["generations"][0]["text"]) for row in QA_ROWS]
        assert set(by_adapter[name]) == {"exact_match", "length"}
        assert any(abs(v - sum(lengths) / len(lengths)) < 1e-6 for v in by_adapter[name]["length"].values()
                   if isinstance(v, float))


def test_resume_runs_only_the_missing_row_adapter_pairs(job_config, adapters, lora_llm) -> None:
    path = _job(job_config, adapters, ["base", "two"], output={"path": str(job_config().parent / "r.jsonl")})
    _, full = _run(path, lora_llm)
    out = Path(load_config(path).output.path)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]))
    summary, resumed = _run(path, lora_llm, "output.if_exists=resume")
    assert summary["records"]["resumed"] == 5 and summary["records"]["this_run"] == len(full) - 5

    def strip(r: dict[str, Any]) -> str:
        return json.dumps({k: v for k, v in r.items() if k != "usage"}, sort_keys=True)

    assert sorted(map(strip, resumed)) == sorted(map(strip, full))


def test_a_glob_of_checkpoints_names_each_by_its_folder(job_config, adapters, lora_llm) -> None:
    path = job_config(data={"limit": 3})
    config = yaml.safe_load(path.read_text())
    config["model"]["adapters"] = str(adapters / "checkpoint-*")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    summary, records = _run(path, lora_llm)
    assert sorted({r["adapter"] for r in records}) == ["checkpoint-1", "checkpoint-2"]
    assert len(records) == 6 and all(r["error"] is None for r in records)


def test_a_scoring_sweep_gives_acc_per_adapter(job_config, adapters, lora_llm, tmp_path) -> None:
    rows = [{"qid": f"m{i}", "question": f"What is {i} plus {i}?", "options": [str(2 * i), "blue", "seven"],
             "label": i % 3} for i in range(6)]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = _job(job_config, adapters, ["base", "two"], metrics=[])
    config = yaml.safe_load(path.read_text())
    config["data"] = {"source": str(data), "id_column": "qid"}
    config["prompt"] = {"template": "Question: {{ question }}\nAnswer:", "chat_template": False}
    config["generation"] = {"mode": "loglikelihood", "choices": "options", "answer": "label", "adapters": ["base", "two"]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    summary, records = _run(path, lora_llm)
    assert summary["status"] == "completed" and len(records) == 2 * len(rows)
    two = LoRARequest("two", 2, str(adapters / "checkpoint-2"))
    for name, request in (("base", None), ("two", two)):
        mine = {r["id"]: r for r in records if r["adapter"] == name}
        pairs = [(f"Question: {row['question']}\nAnswer:", " " + o) for row in rows for o in row["options"]]
        api = iter(lora_llm.loglikelihood(pairs, lora_request=request))
        for row in rows:
            for entry in mine[row["qid"]]["choices"]:
                assert entry["logprob"] == pytest.approx(next(api)[0], abs=1e-5)
        acc = sum(r["chosen"] == r["answer"] for r in mine.values()) / len(rows)
        assert summary["metrics_by_adapter"][name]["accuracy"]["acc"] == pytest.approx(acc)


def test_an_unknown_adapter_name_is_a_config_error(job_config, adapters) -> None:
    path = _job(job_config, adapters, ["base", "three"])
    registry = load_registry(plugin_modules(path, ()))
    with pytest.raises(ConfigError, match="generation.adapters") as err:
        plan(load_config(path, (), registry=registry), registry, prepare=False)
    assert "'three'" in str(err.value) and "one" in str(err.value)


def test_batch_lines_pick_their_adapter_by_model(tmp_path, tiny_llama, tiny_engine, adapters, lora_llm, capsys) -> None:
    from batchgen.cli import main

    def line(custom_id: str, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": "Q: What is 2 plus 2?\nA:", "max_tokens": 6, "temperature": 0}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line(c, m)) + "\n" for c, m in
                              [("a", "one"), ("b", tiny_llama), ("c", "nope"), ("d", "one")]))
    out = tmp_path / "out.jsonl"
    engine = [f"--set=engine.{k}={v}" for k, v in tiny_engine.items()]
    code = main(["batch", str(source), "-o", str(out), "--model", tiny_llama, "--set", "model.device=cpu",
                 "--quiet", *engine, "--lora", f"one={adapters / 'checkpoint-1'}"])
    capsys.readouterr()
    assert code == 0
    lines = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    text = {k: (lines[k]["response"]["body"] or {}).get("choices", [{}])[0].get("text") for k in "abd"}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = "Q: What is 2 plus 2?\nA:"
    want_one = lora_llm.generate([prompt], params, lora_request=LoRARequest("one", 1, str(adapters / "checkpoint-1")))
    want_base = lora_llm.generate([prompt], params)
    assert text["a"] == text["d"] == want_one[0].outputs[0].text
    assert text["b"] == want_base[0].outputs[0].text != text["a"]
    assert lines["c"]["response"]["status_code"] == 404
    # each answer names the model that answered it, as vllm serve does: the adapter's name, or the base's
    assert lines["a"]["response"]["body"]["model"] == lines["d"]["response"]["body"]["model"] == "one"
    assert lines["b"]["response"]["body"]["model"] != "one"
