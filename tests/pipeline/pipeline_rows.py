"""Data the pipeline tests share: the question-answer rows and the tiny jobs' engine settings
(a module of its own, because a test module cannot import ``conftest`` by name reliably: with
several conftest files, ``from conftest import`` finds whichever was imported first)."""

from __future__ import annotations

QA_ROWS = [{"qid": f"q{i:02d}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]

# Engine settings that keep the tiny model's KV cache small and the runs quick.
TINY_ENGINE = {"kv_cache_memory": "16MiB", "max_num_seqs": 8, "block_size": 16}
