"""The local executor: one engine in this process (``executor.backend: local``, the default).

This module imports neither torch nor the engine at import time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batchgen.config import RunConfig
from batchgen.run.executors import engine_config, replica_figures, stats_dict, thread_figures

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """One engine in this process: :meth:`stream` is ``LLM.stream``."""

    backend = "local"

    def __init__(self, config: RunConfig, llm: Any = None) -> None:
        self.config = config
        self.llm = llm
        self.tokenizer: Any = getattr(llm, "tokenizer", None)
        self.max_model_len: int | None = getattr(llm, "max_model_len", None)
        self._records = self._tokens = 0
        self._seconds = 0.0
        self._before: dict[str, Any] = {}

    def start(self) -> None:
        if self.llm is None:
            # deferred: `LLM` imports torch; the run layer stays torch-free
            from batchgen import LLM

            self.llm = LLM(config=engine_config(self.config))
        self.tokenizer, self.max_model_len = self.llm.tokenizer, self.llm.max_model_len

    def stream(self, requests: Iterable[Any], on_tokens: Callable[[int], None] | None = None) -> Iterator[Any]:
        self._records = self._tokens = 0
        self._before = self.stats() or {}
        t0 = time.perf_counter()
        try:
            for output in self.llm.stream(requests, on_tokens=on_tokens):
                self._records += 1
                self._tokens += output.stats.num_generated_tokens
                yield output
        finally:
            self._seconds = time.perf_counter() - t0

    def stats(self) -> dict[str, Any] | None:
        """The engine's counters since it was built (``LLM.stats()``), or None before start."""
        return stats_dict(self.llm.stats()) if self.llm is not None else None

    def describe(self) -> dict[str, Any]:
        per_replica = []
        if self.llm is not None:
            line = replica_figures(self._records, self._tokens, self._seconds, self.stats() or {}, self._before)
            line.update(replica=0, node=socket.gethostname(), pid=os.getpid(), **thread_figures(self.llm), restarts=0)
            per_replica.append(line)
        return {"backend": "local", "replicas": 1, "per_replica": per_replica}

    @property
    def thread_split(self) -> str | None:
        """How the engine's CPU threads are split (``C kernels on 2 thread(s), torch on 1``)."""
        split = getattr(getattr(self.llm, "runner", None), "threads", None)
        return f"threads: {split.describe()}" if split is not None else None

    def close(self) -> None:
        """Nothing to stop: the engine lives as long as this process (or its owner) keeps it."""
