"""The Ray executor's stream (:class:`RowStream`): one :meth:`RayExecutor.stream
<batchgen.run.executors.ray.RayExecutor.stream>` feeding rows to the replicas in small calls
and yielding each record as its call returns, re-running the rows of a replica that crashed;
and :class:`Replica`, the driver's view of one replica, which the stream and the executor share.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchgen.engine.outputs import RequestOutput
from batchgen.plugins import PluginError
from batchgen.run.executors import ExecutorError
from batchgen.run.executors.replica import CALL_MAX_SECONDS

__all__ = ["CALLS_PER_REPLICA", "MAX_ROW_CRASHES", "MAX_START_FAILURES", "Replica", "RowStream", "failure_cause"]

logger = logging.getLogger("batchgen.run.executors.ray")  # the executor's logger, as before the split

#: A row in flight on a replica that crashed this many times becomes an error record. From
#: its second crash on, the row runs alone on a replica, so that the crash is its own.
MAX_ROW_CRASHES = 3
#: Calls queued per replica: the next call waits in the actor while the driver handles the last
#: one's records, so the replica never idles on the round trip.
CALLS_PER_REPLICA = 2
#: Restarts of one replica in a row that fail to start before the run gives up.
MAX_START_FAILURES = 3


class ReplicaPool(Protocol):
    """What a :class:`RowStream` uses of its executor (:class:`~batchgen.run.executors.ray.RayExecutor`,
    which imports this module): Ray, the replicas, the calls each may have in flight, and folding,
    killing and launching a replica when it crashes."""

    _ray: Any
    replicas: list[Replica]

    def in_flight_limit(self) -> int: ...

    def _fold(self, replica: Replica) -> None: ...

    def _kill(self, replica: Replica) -> None: ...

    def _launch(self, replica: Replica) -> None: ...


@dataclass
class Replica:
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


class RowStream:
    """One :meth:`RayExecutor.stream`: the rows still to run, the calls in flight and the crashes.

    Rows come from ``source`` (read lazily), or from ``retry`` (their replica crashed once: they
    run again with others) and ``suspects`` (crashed twice or more: they run again alone).
    ``calls`` maps each Ray call in flight to its replica, the replica's incarnation and its kind
    (``"step"`` or ``"ready"``).
    """

    def __init__(self, executor: ReplicaPool, requests: Iterable[Any],
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
        self.calls: dict[Any, tuple[Replica, int, str]] = {}  # ObjectRef -> (replica, incarnation, kind)
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
                                        f"{replica.start_failures} times in a row: {failure_cause(exc)}") from None
            yield from self.crashed(replica, exc)
            self.feed()
            return
        if kind == "ready":
            replica.info, replica.ready, replica.start_failures = result, True, 0
            self.feed()
            return
        yield from self.stepped(replica, result)

    def stepped(self, replica: Replica, result: tuple[list[Any], int, dict[str, Any]]) -> Iterator[Any]:
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

    def next_row(self, replica: Replica) -> Any:
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

    def call(self, replica: Replica, rows: list[Any]) -> None:
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

    def crashed(self, replica: Replica, exc: Exception) -> Iterator[Any]:
        """Restart ``replica``; its in-flight rows run again, or fail after MAX_ROW_CRASHES."""
        self.crashes_in_a_row += 1
        why = failure_cause(exc)
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


def failure_cause(exc: BaseException) -> str:
    """A one-line reason for a Ray failure (the remote exception's own message when there is one)."""
    cause = _cause_exception(exc)
    text = str(cause).strip()
    if cause is exc:
        # Ray's actor-died messages are long; their first line says what happened.
        text = text.splitlines()[0] if text else ""
    else:
        text = text.splitlines()[-1] if text else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
