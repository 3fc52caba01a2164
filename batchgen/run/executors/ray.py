"""The Ray executor's driver: engine replicas on a Ray cluster, fed by this process.

The driver-fed design (rather than Ray Data's ``map_batches``): rows stream from the driver to
the replicas in small calls, each call returning the records that finished meanwhile, so the
single writer (the run loop) appends records in finish order as they come, a replica's
in-flight rows are known exactly (re-run after a crash, never lost or written twice), and the
work in flight per replica is bounded. See :mod:`batchgen.run.executors` for the contract and
docs/scale-out.md for the user's view. Ray comes from :func:`~batchgen.run.executors.cluster.import_ray`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.config import RunConfig
from batchgen.engine.config import EngineConfig
from batchgen.engine.outputs import RequestOutput
from batchgen.model_resolver import resolve_model
from batchgen.plugins import PluginError
from batchgen.run.executors import ExecutorError, engine_config, replica_figures
from batchgen.run.executors.cluster import caller_signal_handlers, import_ray
from batchgen.run.executors.replica import CALL_MAX_SECONDS, COUNTERS, EngineReplica, aggregate_stats

__all__ = ["MAX_ROW_CRASHES", "RayExecutor"]

logger = logging.getLogger(__name__)

#: A row in flight on a replica that crashed this many times becomes an error record. From
#: its second crash on, the row runs alone on a replica, so that the crash is its own.
MAX_ROW_CRASHES = 3
#: Calls queued per replica: the next call waits in the actor while the driver handles the last
#: one's records, so the replica never idles on the round trip.
CALLS_PER_REPLICA = 2
#: Restarts of one replica in a row that fail to start before the run gives up.
MAX_START_FAILURES = 3


@dataclass
class _Replica:
    """The driver's view of one replica (across restarts)."""

    index: int
    actor: Any = None
    incarnation: int = 0
    ready: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    in_flight: dict[str, Any] = field(default_factory=dict)  # request id -> Request
    calls: int = 0
    solo: bool = False  # running one suspect row alone
    restarts: int = 0
    start_failures: int = 0
    # Engine counters: the live incarnation's last snapshot, and those of dead ones summed.
    stats: dict[str, Any] = field(default_factory=dict)
    retired: dict[str, Any] = field(default_factory=dict)
    # This run's figures.
    records: int = 0
    tokens: int = 0
    first_call: float | None = None
    last_result: float | None = None
    before: dict[str, Any] = field(default_factory=dict)


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
        self.replicas: list[_Replica] = []
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
        self.replicas = [_Replica(i) for i in range(count)]
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
                raise ExecutorError(f"replica {replica.index} failed to start: {_cause(exc)}") from None
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

    def _launch(self, replica: _Replica) -> None:
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
        yield from _Stream(self, requests, on_tokens).run()

    def _fold(self, replica: _Replica) -> None:
        """Keep a dying incarnation's counters (its engine's die with it)."""
        replica.retired = self._replica_stats(replica)
        replica.stats = {}

    def _kill(self, replica: _Replica) -> None:
        if replica.actor is not None:
            try:
                self._ray.kill(replica.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - it may be gone already
                pass
            replica.actor = None
            replica.ready = False

    # ---------------------------------------------------------------- figures
    def _replica_stats(self, replica: _Replica) -> dict[str, Any]:
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


class _Stream:
    """One :meth:`RayExecutor.stream`: the rows still to run, the calls in flight and the crashes.

    Rows come from ``source`` (read lazily), or from ``retry`` (their replica crashed once: they
    run again with others) and ``suspects`` (crashed twice or more: they run again alone).
    ``calls`` maps each Ray call in flight to its replica, the replica's incarnation and its kind
    (``"step"`` or ``"ready"``).
    """

    def __init__(self, executor: RayExecutor, requests: Iterable[Any],
                 on_tokens: Callable[[int], None] | None) -> None:
        self.executor = executor
        self.ray = executor._ray
        self.replicas = executor.replicas
        self.on_tokens = on_tokens
        self.source = iter(requests)
        self.exhausted = False
        self.retry: collections.deque[Any] = collections.deque()
        self.suspects: collections.deque[Any] = collections.deque()
        self.crashes: dict[str, int] = {}
        self.calls: dict[Any, tuple[_Replica, int, str]] = {}  # ObjectRef -> (replica, incarnation, kind)
        self.limit = executor.in_flight_limit()
        self.crashes_in_a_row = 0

    def run(self) -> Iterator[Any]:
        """Feed the replicas and yield each output as its call returns, until every row is done."""
        self.feed()
        try:
            while self.calls:
                done, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=1.0)
                for ref in done:
                    yield from self.returned(ref)
                if not self.calls and (self.retry or self.suspects or not self.exhausted):
                    self.feed()  # e.g. every replica was restarting
            if self.retry or self.suspects:
                raise ExecutorError(f"{len(self.retry) + len(self.suspects)} row(s) were left without a replica")
        finally:
            for replica in self.replicas:
                replica.in_flight.clear()
                replica.calls = 0

    def returned(self, ref: Any) -> Iterator[Any]:
        """Handle one finished call: a replica ready, a step's outputs, or a crash."""
        entry = self.calls.pop(ref, None)
        if entry is None:
            return
        replica, incarnation, kind = entry
        if incarnation != replica.incarnation:
            return
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            if _is_plugin_error(exc):
                raise _cause_exception(exc) from None
            if kind == "ready":
                replica.start_failures += 1
                if replica.start_failures >= MAX_START_FAILURES:
                    raise ExecutorError(f"replica {replica.index} failed to start "
                                        f"{replica.start_failures} times in a row: {_cause(exc)}") from None
            yield from self.crashed(replica, exc)
            self.feed()
            return
        if kind == "ready":
            replica.info, replica.ready, replica.start_failures = result, True, 0
            self.feed()
            return
        yield from self.stepped(replica, result)

    def stepped(self, replica: _Replica, result: tuple[list[Any], int, dict[str, Any]]) -> Iterator[Any]:
        """A step call's outputs: settle the replica, queue its next call, then yield them."""
        outputs, tokens, stats = result
        replica.calls -= 1
        replica.stats = stats
        replica.last_result = time.perf_counter()
        for output in outputs:
            replica.in_flight.pop(output.request_id, None)
        if not replica.in_flight:
            replica.solo = False
        # Queue the replica's next call before writing: it keeps generating meanwhile.
        self.feed()
        if outputs:
            self.crashes_in_a_row = 0
        if self.on_tokens is not None and tokens:
            self.on_tokens(tokens)
        for output in outputs:
            replica.records += 1
            replica.tokens += output.stats.num_generated_tokens
            yield output

    def next_row(self, replica: _Replica) -> Any:
        """The next row for ``replica`` (None: nothing for it now)."""
        if replica.solo:
            return None
        if self.suspects and not replica.in_flight:
            replica.solo = True
            return self.suspects.popleft()
        if self.retry:
            return self.retry.popleft()
        if not self.exhausted:
            try:
                return next(self.source)
            except StopIteration:
                self.exhausted = True
        return None

    def call(self, replica: _Replica, rows: list[Any]) -> None:
        for request in rows:
            replica.in_flight[request.request_id] = request
        ref = replica.actor.step.remote(rows, CALL_MAX_SECONDS)
        self.calls[ref] = (replica, replica.incarnation, "step")
        replica.calls += 1
        if replica.first_call is None:
            replica.first_call = time.perf_counter()

    def feed(self) -> None:
        """Top every ready replica up to its limit, one row per replica in turn, and keep
        CALLS_PER_REPLICA calls queued on each replica that has work."""
        new: dict[int, list[Any]] = {r.index: [] for r in self.replicas}
        hungry = [r for r in self.replicas if r.ready]
        while hungry:
            for replica in list(hungry):
                if len(replica.in_flight) + len(new[replica.index]) >= self.limit:
                    hungry.remove(replica)
                    continue
                row = self.next_row(replica)
                if row is None:
                    hungry.remove(replica)
                    continue
                new[replica.index].append(row)
        for replica in self.replicas:
            if not replica.ready:
                continue
            if new[replica.index]:
                self.call(replica, new[replica.index])
            while replica.in_flight and replica.calls < CALLS_PER_REPLICA:
                self.call(replica, [])

    def crashed(self, replica: _Replica, exc: Exception) -> Iterator[Any]:
        """Restart ``replica``; its in-flight rows run again, or fail after MAX_ROW_CRASHES."""
        self.crashes_in_a_row += 1
        why = _cause(exc)
        logger.warning("replica %d crashed (%s); restarting it, %d row(s) to re-run",
                       replica.index, why, len(replica.in_flight))
        for request in replica.in_flight.values():
            rid = request.request_id
            self.crashes[rid] = self.crashes.get(rid, 0) + 1
            if self.crashes[rid] >= MAX_ROW_CRASHES:
                yield _error_output(request, f"the engine replica crashed {self.crashes[rid]} times while running "
                                             f"this row (the last {self.crashes[rid] - 1} with this row alone); "
                                             f"last error: {why}")
            elif self.crashes[rid] >= 2:
                self.suspects.append(request)
            else:
                self.retry.appendleft(request)
        replica.in_flight.clear()
        for ref in [r for r, (rep, _, _) in self.calls.items() if rep is replica]:
            del self.calls[ref]
        executor = self.executor
        executor._fold(replica)
        executor._kill(replica)
        replica.restarts += 1
        if self.crashes_in_a_row > MAX_ROW_CRASHES * (len(self.replicas) + 1):
            raise ExecutorError(f"the replicas crashed {self.crashes_in_a_row} times in a row without finishing "
                                f"a record; last error: {why}")
        executor._launch(replica)
        self.calls[replica.actor.ready.remote()] = (replica, replica.incarnation, "ready")


def _error_output(request: Any, message: str) -> Any:
    prompt = request.prompt
    return RequestOutput(request_id=request.request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=[] if isinstance(prompt, str) else list(prompt), error=message)


def _cause_exception(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _is_plugin_error(exc: BaseException) -> bool:
    return isinstance(_cause_exception(exc), PluginError)


def _cause(exc: BaseException) -> str:
    """A one-line reason for a Ray failure (the remote exception's own message when there is one)."""
    cause = _cause_exception(exc)
    text = str(cause).strip()
    if cause is exc:
        # Ray's actor-died messages are long; their first line says what happened.
        text = text.splitlines()[0] if text else ""
    else:
        text = text.splitlines()[-1] if text else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
