"""The rows of the batchgen_capitals task: capitals.jsonl beside this file, as a dataset (no hub)."""

import json
from pathlib import Path

import datasets


def load(**kwargs) -> datasets.DatasetDict:
    path = Path(__file__).with_name("capitals.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
