"""``json_valid`` and ``json_schema_valid`` in a run: the job's schema found by the metric, the
scores in the records and the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")

from batchgen.config import load_config  # noqa: E402
from batchgen.run.execute import execute  # noqa: E402
from batchgen.run.plan import plan  # noqa: E402
from batchgen.plugins import load_registry  # noqa: E402

#: Short enough that the tiny random model finishes it even one character a token, within 32
#: tokens: ``{"a": true, "b": 7}``.
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["a", "b"], "additionalProperties": False}


def _run(path: Path, llm: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    registry = load_registry()
    config = load_config(path, ["output.if_exists=overwrite"], registry=registry)
    summary = execute(plan(config, registry, config_path=str(path)), quiet=True, llm=llm)
    return summary, [json.loads(line) for line in Path(config.output.path).read_text().splitlines()]


def test_json_metrics_score_a_constrained_run_against_the_jobs_schema(job_config, tiny_llm, tmp_path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    metrics = [{"name": "json_valid"}, {"name": "json_schema_valid"},
               {"name": "json_schema_valid", "label": "other", "options": {"schema": {"type": "array"}}}]
    constrained = job_config(generation={"mode": "sample", "n": 2, "max_tokens": 32,
                                         "structured_outputs": {"json": str(schema_file)}},
                             data={"limit": 3}, metrics=metrics)
    summary, records = _run(constrained, tiny_llm)
    assert summary["records"]["ok"] == 3
    for record in records:
        for gen in record["generations"]:
            assert gen["finish_reason"] == "stop" and isinstance(json.loads(gen["text"])["a"], bool)
        assert record["metrics"]["json_valid"] == {"first": True, "any": True, "mean": 1.0}
        assert record["metrics"]["json_schema_valid"] == {"first": True, "any": True, "mean": 1.0}
        assert record["metrics"]["other"] == {"first": False, "any": False, "mean": 0.0}  # its own schema
    assert summary["metrics"]["json_schema_valid"] == {"first": 1.0, "any": 1.0, "mean": 1.0}
    assert summary["metrics"]["other"] == {"first": 0.0, "any": 0.0, "mean": 0.0}

    # The same model unconstrained writes no JSON; the metric still checks against the given schema.
    free = job_config(generation={"mode": "greedy", "max_tokens": 8}, data={"limit": 3},
                      metrics=[{"name": "json_valid"}, {"name": "json_schema_valid", "options": {"schema": SCHEMA}}])
    summary, records = _run(free, tiny_llm)
    texts = [g["text"] for r in records for g in r["generations"]]
    assert summary["metrics"]["json_schema_valid"]["mean"] == sum(t.strip().startswith("{") and
                                                                  _fits(t) for t in texts) / len(texts) == 0.0


def _fits(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"a", "b"}
