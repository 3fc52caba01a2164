"""``generation.structured_outputs`` end to end on the tiny model: records, length endings, and the
config errors of ``batchgen validate``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")

from batchgen.cli import main  # noqa: E402
from batchgen.config import load_config, plugin_modules  # noqa: E402
from batchgen.run.execute import execute  # noqa: E402
from batchgen.run.plan import plan  # noqa: E402
from batchgen.plugins import load_registry  # noqa: E402


def _run(path: Path, llm: Any, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    registry = load_registry(plugin_modules(path, overrides))
    config = load_config(path, overrides, registry=registry)
    summary = execute(plan(config, registry, config_path=str(path)), quiet=True, llm=llm)
    return summary, [json.loads(line) for line in Path(config.output.path).read_text().splitlines()]


def test_choice_and_regex_runs_in_every_mode(job_config, tiny_llm) -> None:
    """A random model still answers only with what the constraint allows."""
    choices = ["alpha", "beta", "gamma delta"]
    cases = [({"mode": "sample", "n": 3, "temperature": 1.0, "structured_outputs": {"choice": choices}},
              lambda t: t in choices),
             ({"mode": "beam", "beam_width": 2, "structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"mode": "greedy", "max_tokens": 12, "structured_outputs": {"regex": "[0-9]{1,3}(, [0-9]{1,3})?"}},
              lambda t: re.fullmatch("[0-9]{1,3}(, [0-9]{1,3})?", t) is not None)]
    for generation, ok in cases:
        summary, records = _run(job_config(generation=generation, data={"limit": 4}), tiny_llm,
                                "output.if_exists=overwrite")
        assert summary["status"] == "completed" and len(records) == 4
        texts = [g["text"] for r in records for g in r["generations"]]
        assert texts and all(ok(t) for t in texts), texts
        assert all(g["finish_reason"] == "stop" for r in records for g in r["generations"])
        assert summary["config"]["generation"]["structured_outputs"] == {
            "json": None, "regex": None, "choice": None, "grammar": None, "json_object": False,
            **generation["structured_outputs"]}


def test_a_schema_that_cannot_finish_within_max_tokens_gives_length_records(job_config, tiny_llm, tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 30}},
                                  "required": ["s"]}))
    for mode in ({"mode": "greedy"}, {"mode": "beam", "beam_width": 2}):
        summary, records = _run(job_config(generation={**mode, "max_tokens": 5,
                                                       "structured_outputs": {"json": str(schema)}},
                                           data={"limit": 3}), tiny_llm, "output.if_exists=overwrite")
        assert summary["records"]["error"] == 0 and len(records) == 3
        for record in records:
            assert record["error"] is None
            for gen in record["generations"]:
                assert gen["finish_reason"] == "length" and gen["num_tokens"] == 5
                assert gen["text"].startswith('{"s')  # the start of the only legal shape


def test_validate_reports_a_bad_constraint_with_its_key(job_config, capsys) -> None:
    code = main(["validate", str(job_config(generation={"structured_outputs": {"regex": "[a-"}}))])
    err = capsys.readouterr().err
    assert code == 2 and "generation.structured_outputs.regex: invalid regex" in err
    assert "Traceback" not in err
    code = main(["validate", str(job_config(generation={"mode": "beam", "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "strin"}}}}}))])
    err = capsys.readouterr().err
    assert code == 2 and "generation.structured_outputs.json: invalid JSON schema" in err


def test_openai_batch_response_format_lines_are_constrained(tmp_path, tiny_llm) -> None:
    """``response_format`` lines run under structured outputs; a schema that does not compile is
    that line's 400."""
    import jsonschema

    from batchgen.config import validate_config

    # Short whatever the model: a random model picks any legal token, so no free-length field.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}

    def chat(custom_id: str, response_format: dict[str, Any], **body: Any) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 32,
            "response_format": response_format, **body}})

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        chat("schema", {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        chat("sampled", {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, n=3, temperature=1.0),
        chat("broken", {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "strng"}}}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    config = validate_config({"model": {"name": tiny_llm.model_name, "device": "cpu", "dtype": "float32"},
                              "data": {"source": str(source), "format": "openai_batch"}, "output": {"path": str(out)}})
    execute(plan(config), quiet=True, llm=tiny_llm)
    lines = {entry["custom_id"]: entry for entry in map(json.loads, out.read_text().splitlines())}
    for custom_id in ("schema", "sampled"):
        choices = lines[custom_id]["response"]["body"]["choices"]
        assert len(choices) == (3 if custom_id == "sampled" else 1)
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    broken = lines["broken"]["response"]
    assert broken["status_code"] == 400
    assert broken["body"]["error"]["param"] == "response_format.json_schema.schema"
