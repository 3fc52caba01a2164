"""Executors: where the engine runs. The run loop streams requests through one, whatever it is.

* :class:`~batchgen.run.executors.local.LocalExecutor`: one :class:`~batchgen.LLM` in this
  process (the default).
* :class:`~batchgen.run.executors.ray.RayExecutor`: N engine replicas, each a Ray actor holding
  its own ``LLM`` on its own GPU or cores, fed by this process (the *driver*). See
  docs/scale-out.md. Ray is an extra, imported only by :mod:`batchgen.run.executors.cluster`.

Contract of both (what :func:`batchgen.run.execute.execute` relies on):

* ``start()`` loads the engine(s); then ``tokenizer`` and ``max_model_len`` are set (an
  executor is the :class:`~batchgen.io.protocols.EngineView` of a run).
* ``stream(requests, on_tokens)`` takes an iterable of :class:`~batchgen.engine.outputs.Request`
  and yields one :class:`~batchgen.engine.outputs.RequestOutput` per request, as each finishes
  (finish order), each request exactly once: a request the engine cannot run, or that crashed
  its replica ``MAX_ROW_CRASHES`` times, comes back with ``error`` set. The iterable is read
  lazily, a bounded number of requests ahead, so memory stays bounded whatever the dataset
  size. ``on_tokens(n)`` is called as tokens are generated.
* ``stats()`` is the engine statistics (``EngineStats.to_dict()``; summed over replicas),
  ``describe()`` what the run summary records under ``executor`` (per-replica figures), and
  ``thread_split`` one line saying how the CPU threads are split (None when not known).
* ``close()`` stops every replica (also after Ctrl-C); it is idempotent.

Both ship the job's one :class:`~batchgen.engine.config.EngineConfig` (:func:`engine_config`)
to the engine(s). This package imports neither torch nor Ray at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.config import RunConfig
from batchgen.engine.config import EngineConfig

if TYPE_CHECKING:
    from batchgen.run.executors.local import LocalExecutor
    from batchgen.run.executors.ray import RayExecutor

__all__ = ["ExecutorError", "check_executor", "engine_config", "make_executor"]


class ExecutorError(RuntimeError):
    """The executor cannot go on (replicas that cannot start, a cluster too small...).

    A runtime failure: the pipeline turns it into a failed run (exit status 1)."""


def engine_config(config: RunConfig) -> EngineConfig:
    """The :class:`~batchgen.engine.config.EngineConfig` of a run's ``model`` and ``engine`` sections
    (built by the section itself: :meth:`batchgen.config.EngineSection.to_engine_config`)."""
    return config.engine.to_engine_config(config.model)


def make_executor(config: RunConfig, llm: Any = None) -> LocalExecutor | RayExecutor:
    """The executor ``config.executor`` asks for (not started); ``llm`` reuses a loaded engine."""
    if llm is not None or config.executor.backend == "local":
        # cycle: local.py imports this package
        from batchgen.run.executors.local import LocalExecutor

        return LocalExecutor(config, llm)
    # cycle: ray.py imports this package
    from batchgen.run.executors.ray import RayExecutor

    return RayExecutor(config)


def check_executor(config: RunConfig) -> None:
    """Checks that need no cluster: with ``backend: ray``, that Ray can be imported.

    Raises:
        ConfigError: naming ``executor.backend`` and the extra to install.
    """
    if config.executor.backend == "ray":
        # cycle: cluster.py imports this package (and it defers Ray)
        from batchgen.run.executors.cluster import import_ray

        import_ray()


def stats_dict(stats: Any) -> dict[str, Any]:
    return stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)


def thread_figures(engine: Any) -> dict[str, Any]:
    """``threads`` (batchgen's: the engine's resolved ``num_threads``, which its C kernels run
    on) and ``torch_threads`` (torch's intra-op pool) of an engine in this process."""
    # deferred: torch (~5 s; the engine has loaded it) only for the figures; the run layer stays torch-free
    import torch

    split = getattr(getattr(engine, "runner", None), "threads", None)
    torch_threads = torch.get_num_threads()
    return {"threads": getattr(split, "kernels", torch_threads), "torch_threads": torch_threads}


def replica_figures(records: int, tokens: int, seconds: float, stats: dict[str, Any],
                     before: dict[str, Any]) -> dict[str, Any]:
    """One replica's line of the summary: this run's records, tokens, speed, preemptions, KV peak."""
    num_blocks = stats.get("num_blocks") or 0
    peak = stats.get("peak_blocks_used", 0)
    return {
        "records": records,
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "preemptions": int(stats.get("num_preemptions", 0)) - int(before.get("num_preemptions", 0)),
        "kv_peak_blocks": peak,
        "kv_num_blocks": num_blocks,
        "kv_peak_fraction": peak / num_blocks if num_blocks else 0.0,
    }
