"""Loaders of the local lm-eval test tasks: the JSONL files beside this file, as datasets."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def load_mc(**kwargs) -> datasets.DatasetDict:
    rows = _rows("mc.jsonl")
    split = {s: datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "split"} for r in rows if r["split"] == s])
             for s in ("train", "test")}
    return datasets.DatasetDict(split)


def load_gen(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("gen.jsonl"))})


def load_ppl(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("ppl.jsonl"))})
