"""Fixtures for end-to-end runs: a tiny random Llama with the real SmolLM2 tokenizer.

The model is random, so its text is gibberish, but it runs the whole path (tokenizer, chat
template, paged KV cache, sampling, beams, records, metrics) in well under a second per job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pipeline_rows import QA_ROWS, TINY_ENGINE


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    """Folder of a 2-layer, 64-wide random Llama sharing SmolLM2's 49152-token vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qa_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in QA_ROWS))
    return path


@pytest.fixture
def tiny_engine() -> dict[str, Any]:
    """The ``engine`` section of the tiny jobs (the settings of ``tiny_llm``)."""
    return dict(TINY_ENGINE)


@pytest.fixture
def job_config(tmp_path: Path, tiny_llama: str, qa_file: Path):
    """Factory: ``job_config(**sections) -> Path`` of a YAML job over the QA file and tiny model."""

    def make(**sections: Any) -> Path:
        config: dict[str, Any] = {
            "model": {"name": tiny_llama, "device": "cpu", "dtype": "float32"},
            "data": {"source": str(qa_file), "id_column": "qid"},
            "prompt": {"template": "Q: {{ question }}\nA:", "chat_template": False},
            "generation": {"mode": "greedy", "max_tokens": 8},
            "engine": dict(TINY_ENGINE),
            "metrics": [{"name": "exact_match", "options": {"reference": "answer"}}, {"name": "length"}],
            "output": {"path": str(tmp_path / "out" / "results.jsonl")},
        }
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    return make


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama: str) -> Any:
    """One engine on the tiny model, shared by the in-process runs (loading is the slow part)."""
    from batchgen import LLM

    return LLM(
        model=tiny_llama,
        dtype="float32",
        device="cpu",
        block_size=TINY_ENGINE["block_size"],
        kv_cache_memory=16 * 2**20,
        max_num_seqs=TINY_ENGINE["max_num_seqs"],
        seed=0,
    )



@pytest.fixture
def signal_after_records():
    """``signal_after_records(command, out, records=3, sig=SIGKILL) -> (bytes, returncode, stderr)``:
    start ``command`` (a ``batchgen run``), send it ``sig`` once ``out`` holds ``records``
    complete lines, wait for it to end, and return the file's bytes then, its exit status and its
    stderr. Fails the test if the run ends first or writes nothing within 300 s."""
    import os
    import signal
    import subprocess
    import time

    def run(command: list[str], out: Path, records: int = 3, sig: int = signal.SIGKILL) -> tuple[bytes, int, str]:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        try:
            while not (out.exists() and out.read_bytes().count(b"\n") >= records):
                if proc.poll() is not None:
                    pytest.fail(f"the run ended before the signal: {proc.communicate()[1][-2000:]}")
                if time.monotonic() > deadline:
                    pytest.fail("no records were written within 300 s")
                time.sleep(0.01)
            os.kill(proc.pid, sig)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return out.read_bytes(), proc.returncode, err

    return run


@pytest.fixture
def sigkill_after_records(signal_after_records):
    """``sigkill_after_records(command, out, records=3) -> bytes``: :func:`signal_after_records`
    with SIGKILL; returns the file's bytes after the kill."""
    import signal

    def run(command: list[str], out: Path, records: int = 3) -> bytes:
        data, returncode, _ = signal_after_records(command, out, records)
        assert returncode == -signal.SIGKILL
        return data

    return run
