"""Spans for what went wrong: a ``task`` span for each task no worker
finished (erred, KilledWorker, cancelled while running) and an ``attempt`` span for each
attempt lost with its worker. Each such ending moves the task to a new generation of
span ids (:class:`dask_otel.spans.ids.Carrier`), so no id is ever emitted twice."""

from __future__ import annotations

from time import time_ns
from typing import TYPE_CHECKING, Any

from dask_otel import strings
from dask_otel.plugins.scheduler_spans import Graph, TaskRecord, TaskSpans, failure
from dask_otel.spans import ids

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.plugins.carriers import Carriers
    from dask_otel.plugins.graphs import Graphs
    from dask_otel.spans.emitter import SpanEmitter

#: Stimuli of a task leaving ``processing`` whose attempt its worker reports itself (a
#: failure, or ``Reschedule`` raised by the task): anything else is a cancellation.
REPORTED_BY_WORKER = ("task-erred", "reschedule")
#: Stimulus of a task leaving ``processing`` because Dask turned down the result its
#: worker reported: a stale run (cancelled while running, asked for again, resumed by
#: the worker), which Dask computes again. The worker emitted that run's ``task`` span.
STALE_RESULT = "task-finished"
#: How long the span of an attempt lost with a worker already gone lasts: backends turn
#: down spans of no duration.
LOST_INSTANT_NS = 1_000


class Anomalies:
    """The tasks of one scheduler that went wrong, from the transition or event that
    says so until their spans are submitted."""

    def __init__(
        self,
        scheduler: Scheduler,
        carriers: Carriers,
        graphs: Graphs,
        spans: TaskSpans,
        emitter: SpanEmitter,
    ) -> None:
        self._scheduler = scheduler
        self._carriers = carriers
        self._graphs = graphs
        self._spans = spans
        self._emitter = emitter
        #: Tasks whose result was released: if they run again, it is a new generation.
        self._released_results: set[Any] = set()
        #: Tasks processing on a worker being removed, reported lost, until released.
        self._lost: set[Any] = set()
        #: Workers each task died on (unexpected removals), until it ends.
        self._died_on: dict[Any, list[str]] = {}
        #: Workers a Nanny's memory monitor is killing (Dask's ``worker-restart-memory``
        #: event comes first), until removed: their lost attempts name the cause.
        self._memory_kills: dict[str, dict[str, Any]] = {}

    # -- transitions --------------------------------------------------------------------

    def ended(self, key: Any) -> None:
        """``key`` reached a final state other than ``erred``."""
        if self._died_on or self._released_results:
            self._died_on.pop(key, None)
            self._released_results.discard(key)

    def result_released(self, key: Any) -> None:
        self._released_results.add(key)

    def waiting(self, key: Any) -> None:
        """``key`` waits to run: if its result was lost (its worker died, say), it is
        computed again, in a new generation."""
        if self._released_results and key in self._released_results:
            self._released_results.discard(key)
            self._carriers.next_generation(self._scheduler.tasks.get(key))

    def erred(self, key: Any, start: str, graph: Graph | None, kwargs: dict[str, Any]) -> None:
        """A task erred: the ``task`` span is the scheduler's to emit."""
        ts = self._scheduler.tasks.get(key)
        carrier = self._carriers.of(ts)
        if carrier is None:
            return
        worker = kwargs.get("worker")
        now = time_ns()
        error = failure(ts, kwargs)
        own_failure = error["cause"] in (None, key)
        failed_attempts = _retries_used(ts)
        if start == "processing" and own_failure:
            if worker is not None and worker not in self._scheduler.workers:
                # KilledWorker: its last attempt died with the worker being removed.
                self._lose_attempt(ts, worker, False, now)
            else:
                # The worker reported the failed attempt, under the next generation's span.
                failed_attempts += 1
                self._carriers.next_generation(ts)
            carrier = self._carriers.of(ts)
        elif not (carrier.context.trace_flags.sampled or carrier.generation):
            return  # thinned, never ran: nothing of it was reported, nothing to parent
        died_on = self._died_on.pop(key, [])
        record = self._anomaly(ts, carrier, graph, "erred", now)  # type: ignore[arg-type]
        record.attempts = len(died_on) + failed_attempts
        record.workers = died_on or ([worker] if worker else None)
        record.error = error
        self._emit(ts, record)

    def left_without_result(self, key: Any, start: str, stimulus_id: str | None) -> None:
        """A task left ``processing`` (or waiting, after attempts) without a result."""
        ts = self._scheduler.tasks.get(key)
        carrier = self._carriers.of(ts)
        if carrier is None:
            return
        if key in self._lost:
            self._lost.discard(key)  # reported at the worker's removal
        elif start == "processing" and (stimulus_id or "").startswith(REPORTED_BY_WORKER):
            # A failed or rescheduled attempt, which its worker reports under the span of
            # the next generation; a retry of a thinned task is traced from now on.
            self._carriers.next_generation(ts, traced=True)
        elif start == "processing" and (stimulus_id or "").startswith(STALE_RESULT):
            self._carriers.next_generation(ts)  # the run Dask asks for now: a span id of its own
        elif start == "processing" or carrier.generation:
            # Cancelled while running, or after attempts that were reported: the span
            # they are parented to. A thinned task running had nothing reported.
            if carrier.context.trace_flags.sampled:
                record = self._anomaly(ts, carrier, None, "cancelled", time_ns())
                record.attempts = None
                self._emit(ts, record)
            self._carriers.next_generation(ts)

    # -- workers ------------------------------------------------------------------------

    def memory_kill(self, msg: dict[str, Any]) -> None:
        """A Nanny's memory monitor is killing the worker ``msg`` names."""
        ws = self._scheduler.workers.get(msg.get("worker"))
        self._memory_kills[str(msg.get("worker"))] = {
            "dask.worker.death.cause": "memory",
            "dask.worker.memory.rss_at_kill": int(msg.get("rss") or 0),
            **({"dask.worker.memory.limit": ws.memory_limit} if ws and ws.memory_limit else {}),
        }

    def remove_worker(self, msg: dict[str, Any]) -> None:
        """A worker is being removed, before its tasks are released: each task it was
        running is a lost attempt (Dask emits this event before those transitions)."""
        worker = msg.get("worker")
        expected = bool(msg.get("expected"))
        now = time_ns()
        for key in msg.get("processing-tasks") or ():
            ts = self._scheduler.tasks.get(key)
            # Those that died too often are erred already (KilledWorker, reported then).
            if ts is not None and ts.state == "processing":
                self._lost.add(key)
                self._lose_attempt(ts, worker, expected, now)
        self._memory_kills.pop(worker, None)

    # -- spans --------------------------------------------------------------------------

    def _lose_attempt(self, ts: Any, worker: str | None, expected: bool, now: int) -> None:
        """Emit the ``attempt`` span of ``ts``'s attempt lost with ``worker`` and move the
        task to its next generation, traced (thinned or not)."""
        carrier = self._carriers.of(ts)
        if carrier is None:
            return
        if not expected:
            self._died_on.setdefault(ts.key, []).append(worker)  # type: ignore[arg-type]
        key = strings.key_to_str(ts.key)
        attributes = {
            **self._spans.attributes(ts),
            "dask.worker.address": worker or "",
            "dask.attempt.outcome": "retired" if expected else "worker-died",
            **(self._memory_kills.get(worker, {}) if worker and not expected else {}),
        }
        if carrier.generation:
            attributes["dask.task.generation"] = carrier.generation
        self._carriers.next_generation(ts, traced=True)
        times = (self._last_heard(worker, now), now)
        self._emitter.submit(self._spans.attempt, carrier, key, attributes, expected, times)

    def _last_heard(self, worker: str | None, now: int) -> int:
        """When the scheduler last heard from ``worker`` (ns), where the span of an attempt
        lost with it begins; an instant before ``now`` once the worker is gone."""
        ws = self._scheduler.workers.get(worker) if worker else None
        seen = int(ws.last_seen * 1e9) if ws is not None and ws.last_seen else 0
        return seen if 0 < seen < now else now - LOST_INSTANT_NS

    def _anomaly(
        self, ts: Any, carrier: ids.Carrier, graph: Graph | None, state: str, now: int
    ) -> TaskRecord:
        """The record of a task span the scheduler emits: from its graph's start (if the
        graph is still open) to now, in the task's current generation."""
        graph = graph or self._graphs.by_span(carrier.context.span_id)
        start = graph.start_ns if graph is not None else now
        record = TaskRecord(ts.key, ts.prefix.name, ts.group.name, start)
        record.generation = carrier.generation
        record.state = state
        record.end_ns = now
        return record

    def _emit(self, ts: Any, record: TaskRecord) -> None:
        carrier = self._carriers.of(ts)
        self._carriers.next_generation(ts)  # if it runs again (client.retry), under a new id
        self._emitter.submit(self._spans.task, record, carrier.context)  # type: ignore[union-attr]


def _retries_used(ts: Any) -> int:
    """Attempts of ``ts`` that failed and were retried (``retries`` granted, minus left)."""
    granted = ts.annotations.get("retries") if ts.annotations else None
    return max(0, granted - ts.retries) if isinstance(granted, int) else 0
