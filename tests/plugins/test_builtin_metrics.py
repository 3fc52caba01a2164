"""The built-in metrics and the aggregation helpers, against hand-worked examples."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from batchgen.cli import main
from batchgen.metrics import Metric, distribution_stats, first_any_mean, generation_texts, mean_aggregate
from batchgen.plugins import PluginError, PluginMetric, load_registry


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def record(*texts: str, rid: str = "r0", reasons: list[str] | None = None, tokens: list[int] | None = None) -> dict[str, Any]:
    reasons = reasons or ["stop"] * len(texts)
    tokens = tokens or [len(t.split()) for t in texts]
    return {
        "id": rid,
        "prompt": "q",
        "generations": [
            {"text": t, "finish_reason": f, "num_tokens": n, "cumulative_logprob": -1.0}
            for t, f, n in zip(texts, reasons, tokens)
        ],
    }


def test_built_metrics_satisfy_the_protocol(registry) -> None:
    for name in ("exact_match", "contains", "regex_match", "length", "json_valid", "json_schema_valid"):
        metric = registry.build_metric(name, {})
        assert isinstance(metric, PluginMetric) and isinstance(metric, Metric)
        assert isinstance(metric.inner, Metric) and metric.inner.name == name


def test_exact_match_default_normalisation(registry) -> None:
    metric = registry.build_metric("exact_match", {})
    assert metric.required_columns == ("answer",)
    # Default: lowercase, strip, collapse whitespace; punctuation is kept.
    scores = metric.score(record("  Paris\n", "paris.", "PARIS   France", "Paris France"), {"answer": "Paris  france"})
    assert scores == {"first": False, "any": True, "mean": 0.5}
    assert metric.score(record("Paris"), {"answer": "paris"}) == {"first": True, "any": True, "mean": 1.0}


def test_exact_match_options(registry) -> None:
    strict = registry.build_metric("exact_match", {"lowercase": False, "strip": False, "collapse_whitespace": False})
    assert strict.score(record("Paris", " Paris", "paris"), {"answer": "Paris"}) == {
        "first": True,
        "any": True,
        "mean": pytest.approx(1 / 3),
    }
    squad = registry.build_metric(
        "exact_match", {"reference": "gold", "strip_punctuation": True, "remove_articles": True}
    )
    assert squad.required_columns == ("gold",)
    assert squad.score(record("The Eiffel Tower!", "an eiffel—tower"), {"gold": "Eiffel tower"}) == {
        "first": True,
        "any": True,
        "mean": 0.5,  # the em dash is punctuation and is removed, which joins the words
    }


def test_exact_match_list_reference_and_numbers(registry) -> None:
    metric = registry.build_metric("exact_match", {})
    assert metric.score(record("NYC"), {"answer": ["New York", "nyc"]})["first"] is True
    assert metric.score(record("42"), {"answer": 42})["first"] is True


def test_no_generations_give_none(registry) -> None:
    metric = registry.build_metric("exact_match", {})
    assert metric.score({"id": "e", "generations": []}, {"answer": "x"}) == {"first": None, "any": None, "mean": None}


def test_missing_reference_column_is_named(registry) -> None:
    metric = registry.build_metric("contains", {"reference": "gold"})
    with pytest.raises(PluginError) as info:
        metric.score(record("x", rid="row-3"), {"question": "q", "answer": "a"})
    assert str(info.value) == (
        "metric 'contains' (plugin 'batchgen-builtin-metrics' (built-in)) failed on record 'row-3': "
        "KeyError: \"the row has no column 'gold' (columns: question, answer)\""
    )


def test_contains(registry) -> None:
    metric = registry.build_metric("contains", {})
    assert metric.score(record("I think it is PARIS, the capital.", "London"), {"answer": "paris"}) == {
        "first": True,
        "any": True,
        "mean": 0.5,
    }
    # An empty reference would be contained in anything; it matches nothing instead.
    assert metric.score(record("anything"), {"answer": "  "})["first"] is False


def test_regex_match_gsm8k(registry) -> None:
    metric = registry.build_metric("regex_match", {})
    row = {"answer": "Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72 clips.\n#### 72"}
    scores = metric.score(
        record(
            "She sold 48 + 24 = 72 clips.\n#### 72",  # the final-answer line
            "So the total is 72.00.",  # no #### line: the last number, compared numerically
            "#### 70\nWait, I mean 72",  # the pattern wins over the fallback
            "I cannot tell.",  # nothing extracted
        ),
        row,
    )
    assert scores == {"first": True, "any": True, "mean": 0.5, "extracted": 0.75}
    assert metric.score(record("#### $1,234"), {"answer": "1234"})["first"] is True
    # A unit after the final answer still compares as the number; text answers compare as text.
    assert metric.score(record("#### 72 clips"), {"answer": "#### 72"})["first"] is True
    assert metric.score(record("#### 7 or 72"), {"answer": "#### 72"})["first"] is False
    assert metric.score(record("#### Paris"), {"answer": "#### paris"})["first"] is True


def test_regex_match_options(registry) -> None:
    metric = registry.build_metric(
        "regex_match",
        {"pattern": r"answer is \(?([A-D])\)?", "fallback": "none", "numeric": False, "reference": "label"},
    )
    assert metric.required_columns == ("label",)
    scores = metric.score(record("The answer is (B).", "The answer is C", "B"), {"label": "b"})
    assert scores == {"first": True, "any": True, "mean": pytest.approx(1 / 3), "extracted": pytest.approx(2 / 3)}
    first = registry.build_metric("regex_match", {"pattern": r"\d+", "occurrence": "first"})
    assert first.score(record("3 then 4"), {"answer": "3"})["first"] is True
    not_numeric = registry.build_metric("regex_match", {"numeric": False})
    assert not_numeric.score(record("#### 72.0"), {"answer": "#### 72"})["first"] is False


def test_regex_match_rejects_a_bad_pattern(registry) -> None:
    with pytest.raises(PluginError) as info:
        registry.build_metric("regex_match", {"pattern": "(unclosed"})
    assert str(info.value) == (
        "metric 'regex_match' (plugin 'batchgen-builtin-metrics' (built-in)): invalid options:\n"
        "  pattern: Value error, invalid regular expression: missing ), unterminated subpattern at "
        "position 0 (got '(unclosed')"
    )


def test_length(registry) -> None:
    metric = registry.build_metric("length", {})
    a = metric.score(record("ab", "abcd", reasons=["stop", "length"], tokens=[2, 6]), {})
    b = metric.score(record("abcdef", reasons=["length"], tokens=[10]), {})
    empty = metric.score({"id": "e", "generations": []}, {})
    assert a == {"tokens": 4.0, "chars": 3.0, "tokens_first": 2, "truncated": 0.5}
    assert b == {"tokens": 10.0, "chars": 6.0, "tokens_first": 10, "truncated": 1.0}
    assert empty == {"tokens": None, "chars": None, "tokens_first": None, "truncated": None}
    agg = metric.aggregate([a, b, empty])
    assert agg == pytest.approx(
        {
            "tokens_mean": 7.0, "tokens_min": 4.0, "tokens_p50": 7.0, "tokens_p90": 9.4, "tokens_max": 10.0,
            "chars_mean": 4.5, "chars_min": 3.0, "chars_p50": 4.5, "chars_p90": 5.7, "chars_max": 6.0,
            "truncated_frac": 0.75,
        }
    )
    with pytest.raises(PluginError, match=r"\n  unit: unknown option. This takes no options.$"):
        registry.build_metric("length", {"unit": "tokens"})


def test_match_aggregate_skips_records_without_generations(registry) -> None:
    metric = registry.build_metric("exact_match", {})
    scores = [
        metric.score(record("a", "b"), {"answer": "a"}),
        metric.score(record("x", "b"), {"answer": "b"}),
        metric.score({"id": "e", "generations": []}, {"answer": "a"}),
    ]
    assert metric.aggregate(scores) == {"first": 0.5, "any": 1.0, "mean": 0.5}


def test_helpers() -> None:
    assert generation_texts({"generations": [{"text": "a"}, {"text": "b"}]}) == ["a", "b"]
    assert generation_texts({"error": "too long"}) == []
    assert first_any_mean([False, True, True, False]) == {"first": False, "any": True, "mean": 0.5}
    assert distribution_stats([None], "x") == {}
    assert distribution_stats([1, 2], "x")["x_p50"] == 1.5
    assert mean_aggregate([{"a": None}, {"a": None, "b": 1}]) == {"b": 1.0}


@given(
    st.lists(
        st.fixed_dictionaries(
            {"x": st.one_of(st.none(), st.booleans(), st.integers(-100, 100)), "y": st.floats(-1e6, 1e6)}
        ),
        max_size=20,
    )
)
def test_mean_aggregate_matches_statistics_mean(rows: list[dict[str, Any]]) -> None:
    got = mean_aggregate(rows)
    xs = [float(r["x"]) for r in rows if r["x"] is not None]
    ys = [r["y"] for r in rows]
    assert ("x" in got) == bool(xs) and ("y" in got) == bool(ys)
    if xs:
        assert got["x"] == pytest.approx(statistics.fmean(xs))
    if ys:
        assert got["y"] == pytest.approx(statistics.fmean(ys), abs=1e-6)


# --------------------------------------------------------------------------- JSON metrics

PRODUCT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "price": {"type": "number", "minimum": 0},
        "category": {"enum": ["toy", "tool", "food"]},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "price", "category"],
    "additionalProperties": False,
}
GOOD = '{"name": "Kite", "price": 12.5, "category": "toy", "tags": ["outdoor"]}'


def test_json_valid(registry) -> None:
    metric = registry.build_metric("json_valid", {})
    assert metric.required_columns == ()
    texts = [
        GOOD,
        ' \n[1, "two", null]\n',  # any JSON value; whitespace around it is allowed
        "42",
        '{"name": "Kite", "price": 12.5',  # cut off by max_tokens
        '{"a": 1} and some prose',  # text after the value
        '{"a": NaN}',  # Python's json extensions are not JSON
        "-Infinity",
        "",
        "{'a': 1}",  # single quotes
        '```json\n{"a": 1}\n```',  # a code block is not JSON unless allowed
    ]
    flags = [metric.score(record(t), {})["first"] for t in texts]
    assert flags == [True, True, True, False, False, False, False, False, False, False]
    assert metric.score(record(*texts), {}) == {"first": True, "any": True, "mean": 0.3}
    assert metric.score({"id": "e", "generations": []}, {}) == {"first": None, "any": None, "mean": None}

    fenced = registry.build_metric("json_valid", {"allow_code_fence": True})
    assert fenced.score(record('```json\n{"a": 1}\n```', '```\n[1]```', '```json\n{"a": 1\n```', GOOD), {}) == {
        "first": True, "any": True, "mean": 0.75,
    }


def test_json_schema_valid_with_a_given_schema(registry) -> None:
    metric = registry.build_metric("json_schema_valid", {"schema": PRODUCT})
    cases = {
        GOOD: True,
        '{"name": "Saw", "price": 30, "category": "tool", "in_stock": true}': True,
        '{"name": "Saw", "price": 30}': False,  # a required field is missing
        '{"name": "Saw", "price": "30", "category": "tool"}': False,  # wrong type
        '{"name": "Saw", "price": -1, "category": "tool"}': False,  # below the minimum
        '{"name": "Saw", "price": 30, "category": "car"}': False,  # not in the enum
        '{"name": "Saw", "price": 30, "category": "tool", "colour": "red"}': False,  # additionalProperties
        '{"name": "Saw", "price": 30, "category": "tool", "tags": ["a", "b", "c", "d"]}': False,  # maxItems
        '{"name": "Saw", "price": 30, "category": "tool"': False,  # not JSON at all
        '[{"name": "Saw", "price": 30, "category": "tool"}]': False,  # JSON, but not an object
    }
    for text, expected in cases.items():
        assert metric.score(record(text), {})["first"] is expected, text
    scores = [metric.score(record(*cases), {}), metric.score(record(GOOD, GOOD), {}), metric.score(record("no"), {})]
    assert scores[0] == {"first": True, "any": True, "mean": 0.2}
    assert metric.aggregate(scores) == pytest.approx({"first": 2 / 3, "any": 2 / 3, "mean": 1.2 / 3})


def test_json_schema_valid_reads_a_schema_file(registry, tmp_path, monkeypatch) -> None:
    (tmp_path / "product.schema.json").write_text(json.dumps(PRODUCT))
    monkeypatch.chdir(tmp_path)  # relative paths are relative to the working directory
    for given in ("product.schema.json", str(tmp_path / "product.schema.json")):
        metric = registry.build_metric("json_schema_valid", {"schema": given})
        assert metric.score(record(GOOD, '{"name": "Saw"}'), {}) == {"first": True, "any": True, "mean": 0.5}


def test_json_schema_valid_takes_the_jobs_schema(registry, tmp_path) -> None:
    metric = registry.build_metric("json_schema_valid", {})
    with pytest.raises(PluginError, match="no JSON schema"):
        metric.score(record(GOOD), {})  # not configured with a job
    metric.inner.configure({"generation": {"structured_outputs": {"json": PRODUCT}}})
    assert metric.score(record(GOOD, '{"name": "Saw"}'), {}) == {"first": True, "any": True, "mean": 0.5}

    path = tmp_path / "product.schema.json"
    path.write_text(json.dumps(PRODUCT))
    from_file = registry.build_metric("json_schema_valid", {}).inner
    from_file.configure({"generation": {"structured_outputs": {"json": str(path)}}})
    assert from_file.score(record('{"name": "Saw"}', GOOD), {})["mean"] == 0.5

    # A schema in the options wins over the job's.
    anything = registry.build_metric("json_schema_valid", {"schema": {"type": "array"}})
    anything.inner.configure({"generation": {"structured_outputs": {"json": PRODUCT}}})
    assert anything.score(record(GOOD, "[1]"), {}) == {"first": False, "any": True, "mean": 0.5}

    for job in ({"generation": {}}, {"generation": {"structured_outputs": None}},
                {"generation": {"structured_outputs": {"json_object": True}}}):
        with pytest.raises(ValueError, match=r"set generation.structured_outputs.json, or give the metric one in "
                                             r"options.schema"):
            registry.build_metric("json_schema_valid", {}).inner.configure(job)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("missing.json", "schema: Value error, schema file 'missing.json' does not exist"),
        ({"type": "strnig"}, "schema: Value error, not a valid JSON schema: 'strnig' is not valid under any of the given schemas (at 'type')"),
        ("{not json", "schema: Value error, the schema text is not valid JSON"),
    ],
)
def test_json_schema_valid_rejects_a_bad_schema(registry, schema, message) -> None:
    with pytest.raises(PluginError) as info:
        registry.build_metric("json_schema_valid", {"schema": schema})
    assert str(info.value).startswith(
        "metric 'json_schema_valid' (plugin 'batchgen-builtin-metrics' (built-in)): invalid options:\n  " + message
    )


def test_json_schema_valid_file_must_hold_an_object(registry, tmp_path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(PluginError, match=r"schema: Value error, schema file '.*list.json' must hold a JSON object"):
        registry.build_metric("json_schema_valid", {"schema": str(path)})
    with pytest.raises(PluginError, match=r"  schem: unknown option"):
        registry.build_metric("json_schema_valid", {"schem": PRODUCT})


def test_json_schema_valid_names_the_extra_without_jsonschema(registry, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema now raises ImportError
    with pytest.raises(PluginError, match=re.escape("needs the jsonschema library: pip install 'batchgen[structured]'")):
        registry.build_metric("json_schema_valid", {"schema": PRODUCT})
    assert registry.build_metric("json_valid", {}).score(record(GOOD), {})["first"] is True  # needs no extra


def _validate(tmp_path: Path, model: str, capsys, metrics: list[dict[str, Any]], plugins: list[str] = ()
              ) -> tuple[int, str]:
    """``batchgen validate`` of a one-row job with these metrics: (exit code, stderr)."""
    data = tmp_path / "seeds.jsonl"
    data.write_text('{"prompt": "Describe a toy."}\n')
    config = {"model": {"name": model}, "data": {"source": str(data)}, "generation": {"max_tokens": 8},
              "metrics": metrics, "output": {"path": str(tmp_path / "out.jsonl")}, "plugins": list(plugins)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.err


def test_json_schema_valid_config_errors_name_the_key(tmp_path, smollm2_path, capsys) -> None:
    code, err = _validate(tmp_path, smollm2_path, capsys, [{"name": "json_valid"}, {"name": "json_schema_valid"}])
    assert code == 2
    assert ("metrics.1: metric 'json_schema_valid': no JSON schema to check against: set "
            "generation.structured_outputs.json, or give the metric one in options.schema") in err
    code, err = _validate(tmp_path, smollm2_path, capsys,
                          [{"name": "json_schema_valid", "options": {"schema": "nowhere/product.json"}}])
    assert code == 2
    assert ("metrics.0: invalid options for metric plugin 'json_schema_valid': schema: Value error, schema file "
            "'nowhere/product.json' does not exist") in err
    code, err = _validate(tmp_path, smollm2_path, capsys, [{"name": "json_schema_valid", "options": {"schema": PRODUCT}}])
    assert (code, err) == (0, "")


def test_a_metric_sees_the_resolved_config_once(tmp_path, smollm2_path, capsys, make_module) -> None:
    """``configure`` gets the resolved config; anything but a ValueError names the plugin."""
    module = make_module("bg_configured_metric", '''
        from pydantic import BaseModel
        from batchgen.plugins import MetricSpec, hookimpl

        SEEN = []

        class Opts(BaseModel):
            fail: bool = False

        class Seen:
            name = "seen"
            def __init__(self, opts):
                self.opts = opts
            def configure(self, config):
                if self.opts.fail:
                    raise KeyError("boom")
                SEEN.append(config)
            def score(self, record, row):
                return {}
            def aggregate(self, scores):
                return {}

        @hookimpl
        def batchgen_register_metrics():
            return [MetricSpec("seen", "records the config", Opts, Seen)]
        ''')
    code, err = _validate(tmp_path, smollm2_path, capsys, [{"name": "seen"}, {"name": "seen", "label": "again"}],
                          plugins=[module])
    assert (code, err) == (0, "")
    seen = sys.modules[module].SEEN
    assert len(seen) == 2 and seen[0]["generation"]["max_tokens"] == 8 and seen[0]["metrics"][1]["label"] == "again"
    code, err = _validate(tmp_path, smollm2_path, capsys, [{"name": "seen", "options": {"fail": True}}],
                          plugins=[module])
    assert code == 2
    assert f"metric 'seen' (plugin '{module}' (module)) could not be configured: KeyError: 'boom'" in err
