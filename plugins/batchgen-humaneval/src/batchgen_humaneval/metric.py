"""The ``pass_at_k`` metric: run each generation against the problem's tests, then estimate
pass@k for every requested k.

A record is one problem with ``n`` generations (samples). Each generation becomes a program::

    <prompt><completion>        # or <prompt>\n<code> when the generation is a whole function
    <test>
    check(<entry_point>)

which passes when it exits with status 0 (see :mod:`batchgen_humaneval.execution`). With ``c``
passing generations, ``pass@k`` is the unbiased estimate for each ``k <= n`` (None for larger k);
the run-level value is the mean over problems, as in the HumanEval paper.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchgen_humaneval.estimator import pass_at_k
from batchgen_humaneval.execution import ExecutionResult, run_program

CompletionMode = Literal["auto", "continuation", "full"]

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


class PassAtKOptions(BaseModel):
    """Options of the ``pass_at_k`` metric."""

    model_config = ConfigDict(extra="forbid")

    k: list[int] = Field(default_factory=lambda: [1, 10], min_length=1, description="The k values to report.")
    timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="Wall-clock limit per program, in seconds.")
    memory_mb: int = Field(512, ge=64, description="Address-space limit per program, in MiB.")
    workers: int = Field(
        default_factory=lambda: os.cpu_count() or 1, ge=1, description="Programs run at once for one record."
    )
    prompt_column: str = Field("prompt", description="Column with the function signature and docstring.")
    test_column: str = Field("test", description="Column with the test code defining check(candidate).")
    entry_point_column: str = Field("entry_point", description="Column with the function's name.")
    completion: CompletionMode = Field(
        "auto",
        description=(
            "How a generation becomes code: 'continuation' appends it to the prompt (base models); "
            "'full' uses it alone; 'auto' takes the first ``` block if any and uses it as a whole "
            "definition when it defines the entry point, else as a continuation."
        ),
    )

    @field_validator("k")
    @classmethod
    def _positive_unique(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError("every k must be at least 1")
        return sorted(set(value))


def extract_code(text: str) -> str:
    """The first fenced code block of ``text`` (an unclosed one runs to the end), else ``text``."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def build_program(prompt: str, generation: str, test: str, entry_point: str, mode: CompletionMode) -> str:
    """The program that runs one generation against the problem's tests."""
    if mode == "continuation":
        body = prompt + generation
    elif mode == "full":
        body = extract_code(generation)
    else:
        code = extract_code(generation)
        defines = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
        # A whole definition follows the prompt (which keeps its imports and helpers); the prompt's
        # docstring-only function is a valid definition that the new one replaces.
        body = prompt + "\n" + code if defines else prompt + code
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


class PassAtK:
    """pass@k over a record's generations, executed in sandboxed subprocesses."""

    name = "pass_at_k"

    def __init__(self, options: PassAtKOptions) -> None:
        self.options = options

    @property
    def required_columns(self) -> tuple[str, ...]:
        o = self.options
        return (o.prompt_column, o.test_column, o.entry_point_column)

    def _column(self, row: Mapping[str, Any], column: str) -> str:
        if column not in row:
            raise KeyError(f"the row has no column '{column}' (columns: {', '.join(map(str, row))})")
        return str(row[column])

    def run(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> list[ExecutionResult]:
        """Execute every generation of ``record``; results in generation order."""
        o = self.options
        prompt = self._column(row, o.prompt_column)
        test = self._column(row, o.test_column)
        entry_point = self._column(row, o.entry_point_column)
        programs = [
            build_program(prompt, str(g.get("text", "")), test, entry_point, o.completion)
            for g in record.get("generations") or ()
        ]
        if not programs:
            return []
        with ThreadPoolExecutor(max_workers=min(o.workers, len(programs))) as pool:
            return list(pool.map(lambda p: run_program(p, o.timeout_s, o.memory_mb), programs))

    def score(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
        results = self.run(record, row)
        n = len(results)
        c = sum(r.status == "passed" for r in results)
        scores: dict[str, Any] = {f"pass@{k}": pass_at_k(n, c, k) if k <= n else None for k in self.options.k}
        scores |= {
            "num_samples": n,
            "num_correct": c,
            "num_timeouts": sum(r.status == "timeout" for r in results),
        }
        return scores

    def aggregate(self, scores: list[dict[str, Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in self.options.k:
            values = [s[f"pass@{k}"] for s in scores if s.get(f"pass@{k}") is not None]
            if values:
                out[f"pass@{k}"] = sum(values) / len(values)
        out["num_problems"] = sum(1 for s in scores if s.get("num_samples"))
        out["num_samples"] = sum(s.get("num_samples") or 0 for s in scores)
        out["num_timeouts"] = sum(s.get("num_timeouts") or 0 for s in scores)
        return out
