"""The built-in metrics and the aggregation helpers, against hand-worked examples."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    for name in ("exact_match", "contains", "regex_match", "length"):
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
