"""docs/plugins.md documents every hook with a working example."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen.plugins import HOOK_NAMES, hookspecs, load_registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def spec_names() -> list[str]:
    """Every hook specification, found by pluggy's marker rather than from a hand-kept list."""
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "batchgen_spec")]


def sections() -> dict[str, str]:
    """``### `name` `` heading → the text up to the next heading."""
    text = DOC.read_text(encoding="utf-8")
    parts = re.split(r"^### `([^`]+)`\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_hook_list_is_complete() -> None:
    assert sorted(spec_names()) == sorted(HOOK_NAMES)


@pytest.mark.parametrize("hook", spec_names())
def test_every_hook_is_documented_with_an_example(hook: str) -> None:
    docs = sections()
    assert hook in docs, f"docs/plugins.md has no '### `{hook}`' section"
    body = docs[hook]
    signature = str(inspect.signature(getattr(hookspecs, hook))).split(" ->")[0]
    assert f"`{hook}(" in body, f"the {hook} section does not state its signature {signature}"
    examples = FENCE.findall(body)
    assert any("@hookimpl" in code and f"def {hook}(" in code for code in examples), (
        f"the {hook} section has no ```python example implementing it"
    )


def test_examples_run_as_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_module: Callable[[str, str], str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the run-end example appends to a file in the working folder
    names = []
    for hook, body in sections().items():
        for i, code in enumerate(FENCE.findall(body)):
            if "@hookimpl" in code:
                names.append(make_module(f"bg_doc_{hook}_{i}", code))
    registry = load_registry(names)

    proc = registry.build_sampler("ban_tokens", {"token_ids": [0, 1]})
    out = proc(torch.zeros(2, 4), [[], []])
    assert torch.isneginf(out[:, :2]).all() and torch.isfinite(out[:, 2:]).all()

    metric = registry.build_metric("word_count", {"max_words": 2})
    scores = [
        metric.score({"id": 1, "generations": [{"text": "one two three"}]}, {}),
        metric.score({"id": 2, "generations": [{"text": "one"}]}, {}),
    ]
    assert scores == [{"words": 3, "too_long": True}, {"words": 1, "too_long": False}]
    assert metric.aggregate(scores) == {"words": 2.0, "too_long": 0.5}

    registry.notify("batchgen_run_start", config={"model": {"name": "m"}, "data": {"source": "d"}})
    registry.notify("batchgen_record_finished", record={"id": 1, "generations": [{"finish_reason": "stop"}]})
    registry.notify("batchgen_run_end", summary={"metrics": {"word_count": {"words": 2.0}}})
    assert (tmp_path / "metrics-history.jsonl").read_text() == '{"word_count": {"words": 2.0}}\n'


def test_builtin_sampler_options_are_documented() -> None:
    """docs/plugins.md names every option of the shipped samplers with its default."""
    import json

    from batchgen.plugins.options import describe_options

    section = DOC.read_text(encoding="utf-8").split("## Built-in samplers", 1)[1].split("\n## ", 1)[0]
    registry = load_registry()
    for name in ("epsilon", "top_a", "typical", "eta"):
        assert f"`{name}`" in section, name
        for option in describe_options(registry.samplers[name].options_model):
            assert f"`{option['name']}`" in section, (name, option["name"])
            assert f"default `{json.dumps(option['default'])}`" in section, (name, option)


def test_the_pyproject_example_is_complete() -> None:
    """The doc's pyproject.toml builds as the shipped plugins' do: [build-system] included."""
    tomllib = pytest.importorskip("tomllib")
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "docs/plugins.md shows no pyproject.toml"
    doc = tomllib.loads(blocks[0])
    shipped = tomllib.loads((DOC.parents[1] / "plugins" / "batchgen-typical" / "pyproject.toml").read_text())
    assert doc["build-system"] == shipped["build-system"]
    assert doc["project"]["entry-points"]["batchgen"] == {"myplugin": "batchgen_myplugin"}
    assert doc["tool"]["setuptools"] == shipped["tool"]["setuptools"]
    assert {"name", "version", "dependencies", "requires-python"} <= set(doc["project"])
    text = DOC.read_text(encoding="utf-8")
    assert "batchgen tokenize MODEL TEXT" in text and "~/.cache/batchgen/models/" in text
