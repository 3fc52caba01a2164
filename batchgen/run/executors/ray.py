"""The Ray executor's driver: engine replicas on a Ray cluster, fed by this process.

The driver-fed design (rather than Ray Data's ``map_batches``): rows stream from the driver to
the replicas in small calls, each call returning the records that finished meanwhile, so the
single writer (the run loop) appends records in finish order as they come, a replica's
in-flight rows are known exactly (re-run after a crash, never lost or written twice), and the
work in flight per replica is bounded. See :mod:`batchgen.run.executors` for the contract and
docs/scale-out.md for the user's view. Ray comes from :func:`~batchgen.run.executors.cluster.import_ray`;
the stream of one run (its calls, its crashes) is :mod:`batchgen.run.executors.ray_stream`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batchgen.config import RunConfig
from batchgen.engine.config import EngineConfig
from batchgen.model_resolver import resolve_model
from batchgen.run.executors import ExecutorError, engine_config, replica_figures
from batchgen.run.executors.cluster import caller_signal_handlers, import_ray
from batchgen.run.executors.replica import COUNTERS, EngineReplica, aggregate_stats
from batchgen.run.executors.ray_stream import MAX_ROW_CRASHES, Replica, RowStream, failure_cause

__all__ = ["MAX_ROW_CRASHES", "RayExecutor"]

logger = logging.getLogger(__name__)


class RayExecutor:
    """Engine replicas on a Ray cluster, fed by this process.

    Args:
        config: the run's config (``model``, ``engine`` and ``executor`` are read).
        engine_factory: builds a replica's engine from :func:`~batchgen.run.executors.engine_config`'s object (default: an
            ``LLM``); a module-level function, so Ray can ship it by reference. The benchmark
            passes an instant fake engine to measure the driver alone.
    """

    backend = "ray"
    thread_split: str | None = None  # each replica's own (see describe())

    def __init__(self, config: RunConfig, engine_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        self.config = config
        self.section = config.executor
        self.engine_factory = engine_factory
        self.tokenizer: Any = None
        self.max_model_len: int | None = None
        self.replicas: list[Replica] = []
        self.num_cpus = 1.0
        self.num_gpus = 0.0
        self.threads = 1
        self.startup: dict[str, float] = {}
        self._ray: Any = None
        self._owns_ray = False
        self._actor_class: Any = None
        self._closed = False

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Connect to (or start) Ray, place the replicas and wait until every one has loaded."""
        ray = self._ray = import_ray()
        t0 = time.perf_counter()
        if not ray.is_initialized():
            address = self.section.address or "local"
            kwargs: dict[str, Any] = dict(address=address, logging_level=logging.ERROR, log_to_driver=True)
            if address == "local":
                kwargs["include_dashboard"] = False
            try:
                with caller_signal_handlers():
                    ray.init(**kwargs)
            except Exception as exc:  # noqa: BLE001 - reported with the address
                raise ExecutorError(f"cannot start or join Ray at {address!r}: {type(exc).__name__}: {exc}") from None
            self._owns_ray = True
        self.startup["ray_init_s"] = time.perf_counter() - t0
        count = self._plan_resources(ray.cluster_resources())
        self._actor_class = ray.remote(EngineReplica)
        t1 = time.perf_counter()
        self.replicas = [Replica(i) for i in range(count)]
        for replica in self.replicas:
            self._launch(replica)
        readies = [replica.actor.ready.remote() for replica in self.replicas]
        # The driver tokenises the prompts (and checks their length) as a local run does; its
        # tokenizer loads while the replicas load their engines.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.engine.tokenizer or resolve_model(
            self.config.model.name, self.config.engine.quantization, self.config.model.device).path)
        self.startup["tokenizer_s"] = time.perf_counter() - t1
        for replica, ready in zip(self.replicas, readies):
            try:
                replica.info = ray.get(ready)
            except ray.exceptions.RayError as exc:
                raise ExecutorError(f"replica {replica.index} failed to start: {failure_cause(exc)}") from None
            replica.ready = True
        self.startup["replicas_ready_s"] = time.perf_counter() - t1
        self.max_model_len = self.replicas[0].info["max_model_len"]
        self.startup["total_s"] = time.perf_counter() - t0
        logger.info("%d replicas ready in %.1f s (Ray %.1f s)", count, self.startup["total_s"],
                    self.startup["ray_init_s"])

    def _plan_resources(self, cluster: dict[str, float]) -> int:
        """Settle replicas, CPUs and GPUs per replica against what the cluster has."""
        wanted = self.section.resources_per_replica
        cpus, gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
        on_cpu = self.config.model.device == "cpu"
        self.num_gpus = float(wanted.num_gpus) if wanted.num_gpus is not None else (1.0 if gpus and not on_cpu else 0.0)
        self.num_cpus = float(wanted.num_cpus) if wanted.num_cpus is not None else 1.0
        self.threads = max(1, int(self.num_cpus))
        if self.section.replicas == "auto":
            count = int(gpus // self.num_gpus) if self.num_gpus else int(cpus // self.num_cpus)
            if count < 1:
                raise ExecutorError(
                    f"executor.replicas 'auto': the cluster has {cpus:g} CPUs and {gpus:g} GPUs, not enough for one "
                    f"replica of {self.num_cpus:g} CPUs and {self.num_gpus:g} GPUs; lower resources_per_replica")
            return count
        count = int(self.section.replicas)
        for name, need, have in (("CPUs", self.num_cpus, cpus), ("GPUs", self.num_gpus, gpus)):
            if need * count > have + 1e-9:
                raise ExecutorError(
                    f"{count} replicas x {need:g} {name} do not fit the Ray cluster, which has {have:g} {name}; "
                    f"lower executor.replicas or executor.resources_per_replica.num_{name[:-1].lower()}s, "
                    "or use replicas: auto")
        return count

    def _launch(self, replica: Replica) -> None:
        engine = engine_config(self.config)
        if self.num_gpus and str(engine.device).startswith("cuda:"):
            engine = dataclasses.replace(engine, device="cuda")  # Ray hands the replica its GPUs as cuda:0...
        replica.actor = self._actor_class.options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_task_retries=0,
        ).remote(engine, self.threads if not self.num_gpus else None, self.engine_factory)
        replica.incarnation += 1
        replica.ready = False
        replica.calls = 0
        replica.solo = False

    def in_flight_limit(self) -> int:
        """Requests in flight per replica: a full batch plus a queue that covers the refill lag."""
        seqs = self.config.engine.max_num_seqs
        return seqs + max(8, seqs // 4)

    # ---------------------------------------------------------------- stream
    def stream(self, requests: Iterable[Any], on_tokens: Callable[[int], None] | None = None) -> Iterator[Any]:
        """Run every request on the replicas; yield each output as it finishes (see module doc)."""
        for replica in self.replicas:
            replica.records = replica.tokens = 0
            replica.first_call = replica.last_result = None
            replica.before = self._replica_stats(replica)
        yield from RowStream(self, requests, on_tokens).run()

    def _fold(self, replica: Replica) -> None:
        """Keep a dying incarnation's counters (its engine's die with it)."""
        replica.retired = self._replica_stats(replica)
        replica.stats = {}

    def _kill(self, replica: Replica) -> None:
        if replica.actor is not None:
            try:
                self._ray.kill(replica.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - it may be gone already
                pass
            replica.actor = None
            replica.ready = False

    # ---------------------------------------------------------------- figures
    def _replica_stats(self, replica: Replica) -> dict[str, Any]:
        """The engine counters of ``replica`` since the executor started, restarts included."""
        stats = {**replica.retired, **replica.stats}
        for key in COUNTERS:
            stats[key] = int(replica.stats.get(key, 0)) + int(replica.retired.get(key, 0))
        stats["peak_blocks_used"] = max(int(replica.stats.get("peak_blocks_used", 0)),
                                        int(replica.retired.get("peak_blocks_used", 0)))
        return stats

    def stats(self) -> dict[str, Any] | None:
        """Engine counters since start, summed over the replicas (see :func:`aggregate_stats`)."""
        return aggregate_stats([self._replica_stats(r) for r in self.replicas])

    def describe(self) -> dict[str, Any]:
        per_replica = []
        for r in self.replicas:
            seconds = (r.last_result - r.first_call) if r.first_call is not None and r.last_result is not None else 0.0
            line = replica_figures(r.records, r.tokens, seconds, self._replica_stats(r), r.before)
            line.update(replica=r.index, node=r.info.get("host"), node_id=r.info.get("node_id"),
                        pid=r.info.get("pid"), threads=r.info.get("threads"),
                        torch_threads=r.info.get("torch_threads"), gpu_ids=r.info.get("gpu_ids"),
                        restarts=r.restarts)
            per_replica.append(line)
        return {"backend": "ray", "address": self.section.address, "replicas": len(self.replicas),
                "resources_per_replica": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                "startup_s": self.startup, "restarts": sum(r.restarts for r in self.replicas),
                "per_replica": per_replica}

    # ---------------------------------------------------------------- stop
    def close(self) -> None:
        """Stop every replica; shut Ray down when this executor started it. Idempotent."""
        if self._closed or self._ray is None:
            return
        self._closed = True
        for replica in self.replicas:
            self._kill(replica)
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
