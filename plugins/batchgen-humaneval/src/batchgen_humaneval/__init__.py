"""batchgen metric plugin: pass@k on HumanEval-style problems.

batchgen finds this module through the ``batchgen`` entry point declared in pyproject.toml and
calls :func:`batchgen_register_metrics`. Generated code is executed only in sandboxed
subprocesses (:mod:`batchgen_humaneval.execution`), never in batchgen's process.
"""

from __future__ import annotations

from pydantic import BaseModel

from batchgen.plugins import MetricSpec, hookimpl
from batchgen_humaneval.estimator import pass_at_k
from batchgen_humaneval.metric import PassAtK, PassAtKOptions

__version__ = "0.1.0"
__all__ = ["PassAtK", "PassAtKOptions", "batchgen_register_metrics", "pass_at_k"]


def _build(options: BaseModel) -> PassAtK:
    assert isinstance(options, PassAtKOptions)
    return PassAtK(options)


@hookimpl
def batchgen_register_metrics() -> list[MetricSpec]:
    """Register ``pass_at_k``."""
    return [
        MetricSpec(
            name="pass_at_k",
            description="HumanEval pass@k: run each generation against the tests in a sandboxed subprocess.",
            options_model=PassAtKOptions,
            factory=_build,
        )
    ]
