"""Scheduler plugin: a ``graph`` span per ``update_graph`` and a ``task`` span per task.

The hot path (``transition``, ~7 calls per task) only appends a tuple to a per-task
record. When a task reaches a final state its record goes to a background thread that
builds the ``task`` span after the fact, back-dated, with the deterministic span id
from :mod:`dask_otel.ids`, so workers can parent their spans to it without asking.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from dask_otel import emitter, errors, events, ids, logs, metrics, naming, rpc, telemetry
from dask_otel.activation import activate
from dask_otel.emitter import SpanEmitter, drain
from dask_otel.telemetry import PLUGIN_NAME

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: States after which a task's span is complete.
FINAL_STATES = frozenset({"memory", "erred", "forgotten"})
#: States a task enters on submission, shown by its span's start rather than by events.
BEFORE_RUN = frozenset({"waiting", "queued"})


class _Graph:
    """One ``update_graph`` call: its span and the tasks still running under it.

    The ``graph`` span is live from ``update_graph`` on (one per graph): starting it is
    how the sampler decides for the whole computation before any task reaches a worker.
    ``carrier`` is the context every task of the graph carries in its annotation.
    """

    __slots__ = ("carrier", "context", "pending", "span")

    def __init__(self, span: trace.Span, carrier: trace.SpanContext) -> None:
        self.span = span
        self.carrier = carrier
        self.pending = 0
        #: The parent context of its ``task`` spans.
        self.context = trace.set_span_in_context(trace.NonRecordingSpan(span.get_span_context()))


class _Task:
    """What the scheduler learns about one task while it lives; turned into a span later."""

    __slots__ = (
        "attempts",
        "compute_seconds",
        "dependencies",
        "dropped_events",
        "end_ns",
        "erred_attempt",
        "error",
        "events",
        "graph",
        "group",
        "kept",
        "key",
        "nbytes",
        "prefix",
        "start_ns",
        "state",
        "worker",
        "workers",
    )

    def __init__(
        self, key: Any, prefix: str, group: str, graph: _Graph, start_ns: int, kept: bool
    ) -> None:
        self.key = key
        self.kept = kept
        self.compute_seconds = 0.0
        self.prefix = prefix
        self.group = group
        self.graph = graph
        self.start_ns = start_ns
        self.end_ns = 0
        # A graph's records live as long as its tasks: no list unless needed, and events in
        # a tuple of plain values, which Python's garbage collector stops tracking.
        self.events: tuple[tuple[str, int, str | None, str | None], ...] = ()
        self.dropped_events = 0
        self.attempts = 0
        #: An attempt failed and was retried: its worker reported it, whatever the thinning.
        self.erred_attempt = False
        self.worker: str | None = None
        #: Every worker it was sent to, once each, when more than one.
        self.workers: list[str] | None = None
        self.state = ""
        self.nbytes: int | None = None
        self.error: dict[str, Any] | None = None
        self.dependencies: list[tuple[Any, Any]] | None = None

    def add_attempt(self, worker: str | None) -> None:
        self.attempts += 1
        if worker is None:
            return
        if self.worker is not None and worker != self.worker:
            if self.workers is None:
                self.workers = [self.worker]
            if worker not in self.workers:
                self.workers.append(worker)
        self.worker = worker

    def add_event(self, event: tuple[str, int, str | None, str | None], limit: int) -> None:
        """Keep the first ``limit - 1`` events and always the latest; count the others."""
        events = self.events
        if len(events) < limit:
            self.events = (*events, event)
        else:
            if events:
                self.events = (*events[:-1], event)
            self.dropped_events += 1


class DaskOtelSchedulerPlugin(SchedulerPlugin):
    """Traces every graph and task on the scheduler it is added to."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._scheduler: Scheduler | None = None
        self._tasks: dict[Any, _Task] = {}
        self._graphs: set[_Graph] = set()
        self._emitter: SpanEmitter | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    async def start(self, scheduler: Scheduler) -> None:
        settings = activate("scheduler")
        if settings is None:
            return
        self._settings: Settings = settings
        self._scheduler = scheduler
        self._providers = telemetry.current()
        tracer = self._providers.tracer()
        self._tracer = tracer
        self._ids = ids.SpanIdSetter(tracer)
        self._cluster_id = scheduler.id
        self._emitter = emitter.shared()
        self._meter_provider = metrics.meter_provider(self._providers, settings)
        metrics.observe_scheduler(self._meter_provider, scheduler)
        self._events = events.EventRecorder(
            self._providers.logger_provider,
            self._cluster_id,
            settings.max_attribute_length,
            settings.logs_exclude_event_topics,
        )
        logs.add_cluster(self._cluster_id)
        self._handlers = rpc.trace_handlers(scheduler, tracer, settings)

    # -- graphs -------------------------------------------------------------------------

    def update_graph(
        self,
        scheduler: Scheduler,
        *,
        client: str,
        keys: set[Any],
        tasks: list[Any],
        annotations: dict[str, dict[Any, Any]],
        **kwargs: Any,
    ) -> None:
        if self._emitter is None:
            return
        injected = annotations.get(ids.ANNOTATION)
        # A user's own ``otel`` annotation is not a carrier: only values that decode count.
        client_carrier = (
            next((v for v in injected.values() if ids.decode(v) is not None), None)
            if injected
            else None
        )
        parent = ids.decode(client_carrier)
        now = time_ns()
        span = self._tracer.start_span(
            "graph"
            if parent
            else naming.graph_name(keys, scheduler.tasks, self._settings.max_attribute_length),
            # A root needs an explicit empty context: never adopt what the loop has current.
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent))
            if parent
            else Context(),
            kind=SpanKind.CONSUMER if parent else SpanKind.INTERNAL,
            start_time=now,
            attributes={
                "dask.cluster.id": self._cluster_id,
                "dask.client.id": client,
                "dask.graph.keys": len(keys),
            },
        )
        if not span.is_recording():
            span.end(now)
            return
        graph = _Graph(span, parent or span.get_span_context())
        carrier = client_carrier if parent else ids.encode(graph.carrier)
        records = self._tasks
        states = scheduler.tasks
        created = []
        for key in tasks:
            ts = states.get(key)
            # Only tasks this graph created are still released; the others (scattered
            # data, results of earlier graphs, running tasks) belong to other spans.
            if ts is None or ts.state != "released" or key in records:
                continue
            annotation = ts.annotations.get(ids.ANNOTATION) if ts.annotations else None
            if annotation is not None and annotation != carrier and ids.decode(annotation):
                continue  # created by an earlier graph: its span lives in that trace
            created.append(ts)
        filtered = self._settings.include_prefixes or self._settings.exclude_prefixes
        # The prefix filters choose first; the span budget is shared by the tasks they keep.
        chosen = [not filtered or self._prefix_traced(ts.prefix.name) for ts in created]
        ratio = self._span_ratio(sum(chosen))
        thinned = ids.encode(ids.with_sampled(graph.carrier, False))
        if self._settings.task_spans:  # the worker reports a thinned task if slow or failed
            thinned += ids.THINNED
        for ts, kept in zip(created, chosen, strict=True):
            prefix = ts.prefix.name
            if kept and ratio < 1:
                kept = ids.keep_task(graph.carrier, ids.key_to_str(ts.key), ratio)
            if ts.annotations is None:
                ts.annotations = {}
            # The carrier's sampled flag tells the worker whether to trace the task.
            ts.annotations[ids.ANNOTATION] = carrier if kept else thinned
            records[ts.key] = _Task(ts.key, prefix, ts.group.name, graph, now, kept)
        graph.pending = len(created)
        span.set_attribute("dask.graph.tasks", graph.pending)
        if ratio < 1:
            span.set_attribute("dask.graph.span_ratio", ratio)
        if graph.pending:
            self._graphs.add(graph)
        else:
            span.end(now)

    def _span_ratio(self, tasks: int) -> float:
        """Share of a graph's tasks that get per-task spans (``otel.task.*``)."""
        settings = self._settings
        ratio = settings.task_sample_ratio if settings.task_spans else 0.0
        if tasks * ratio > settings.max_spans_per_graph:
            ratio = settings.max_spans_per_graph / tasks
        return ratio

    def _prefix_traced(self, prefix: str) -> bool:
        settings = self._settings
        if settings.include_prefixes and prefix not in settings.include_prefixes:
            return False
        return prefix not in settings.exclude_prefixes

    # -- structured events ----------------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        if self._emitter is None:
            return
        # Dask publishes one event under several topics (``all`` and a worker's address)
        # in one loop: gather them, export once from the background thread.
        if self._events.add(topic, msg):
            asyncio.get_running_loop().call_soon(self._flush_event)

    def _flush_event(self) -> None:
        for event in self._events.take():
            if self._emitter is not None:
                self._emitter.submit(self._events.emit, *event)

    # -- tasks (hot path) -----------------------------------------------------------------

    def transition(
        self,
        key: Any,
        start: str,
        finish: str,
        *args: Any,
        stimulus_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        record = self._tasks.get(key)
        if record is None:
            return
        if finish == "processing":
            ws = self._scheduler.tasks[key].processing_on  # type: ignore[union-attr]
            worker = ws.address if ws is not None else None
            record.add_attempt(worker)
        else:
            worker = kwargs.get("worker")
        if finish in FINAL_STATES:
            self._finish(record, finish, time_ns(), kwargs)
        # Events: the states entered between the span's start and end (the final state),
        # but for waiting and queued before the first attempt: the span's start is the
        # submission, and the time to the first ``processing`` is spent in those. Thinned
        # tasks record none.
        elif record.kept:
            if start != finish and (record.attempts or finish not in BEFORE_RUN):
                event = (finish, time_ns(), stimulus_id, worker)
                record.add_event(event, self._settings.max_task_events)
        elif start == "processing" and stimulus_id and stimulus_id.startswith("task-erred"):
            record.erred_attempt = True  # retried (to waiting), or released by a restart

    def _finish(self, record: _Task, state: str, now: int, kwargs: dict[str, Any]) -> None:
        del self._tasks[record.key]
        record.state = state
        record.end_ns = now
        graph = record.graph
        graph.pending -= 1
        if graph.pending == 0:
            self._graphs.discard(graph)
        for startstop in kwargs.get("startstops") or ():
            if startstop.get("action") == "compute":
                record.compute_seconds += startstop["stop"] - startstop["start"]
        ts = self._scheduler.tasks.get(record.key)  # type: ignore[union-attr]
        if state == "erred":
            # As text now: the exception (Dask's own KilledWorker, or a worker's pickle)
            # is not kept until the emitter reports it.
            record.error = {
                "failure": errors.failure(
                    kwargs.get("exception"),
                    kwargs.get("exception_text"),
                    kwargs.get("traceback_text"),
                ),
                "cause": kwargs.get("cause"),
            }
            if record.error["cause"] is None and ts is not None and ts.exception_blame:
                # Dependents of a failed task are erred without kwargs; Dask blames one.
                record.error["cause"] = ts.exception_blame.key
        # Thinned tasks still get a span when an attempt failed (retried or not) or was
        # slow: the worker, which sees the same failure and compute time, emits its
        # execute span too, whose parent this span is.
        failed = record.erred_attempt or (
            state == "erred" and record.error["cause"] in (None, record.key)  # type: ignore[index]
        )
        settings = self._settings
        if record.kept or (
            settings.task_spans and (failed or record.compute_seconds > settings.keep_slower_than)
        ):
            if ts is not None:
                if state == "memory" and ts.nbytes >= 0:
                    record.nbytes = ts.nbytes
                record.dependencies = [
                    (dts.key, dts.annotations.get(ids.ANNOTATION) if dts.annotations else None)
                    for dts in islice(ts.dependencies, settings.max_task_links)
                ]
            self._emitter.submit(self._emit_task, record)  # type: ignore[union-attr]
        if graph.pending == 0:
            self._emitter.submit(graph.span.end, now)  # type: ignore[union-attr]

    # -- emission (background thread) -----------------------------------------------------

    def _emit_task(self, record: _Task) -> None:
        limit = self._settings.max_attribute_length
        prefix = ids.cap(record.prefix, limit)  # a key without "-" is its own prefix
        carrier = record.graph.carrier
        key = ids.key_to_str(record.key)
        attributes: dict[str, Any] = {
            "dask.cluster.id": self._cluster_id,
            "dask.task.key": ids.cap(key, limit),
            "dask.task.prefix": prefix,
            "dask.task.group": ids.cap(record.group, limit),
            "dask.task.state": record.state,
            "dask.task.attempts": record.attempts,
        }
        if record.worker:
            attributes["dask.worker.address"] = record.worker
        if record.workers:
            attributes["dask.task.workers"] = record.workers
        if record.nbytes is not None:
            attributes["dask.task.nbytes"] = record.nbytes
        if record.dropped_events:
            attributes["dask.task.dropped_events"] = record.dropped_events
        span = self._ids.start_span(
            ids.task_span_id(carrier, key),
            f"task {prefix}",
            context=record.graph.context,
            start_time=record.start_ns,
            attributes=attributes,
            links=_dependency_links(record.dependencies or ()),
        )
        for state, timestamp, stimulus_id, worker in record.events:
            event_attributes = {"dask.stimulus.id": stimulus_id} if stimulus_id else {}
            if worker:
                event_attributes["dask.worker.address"] = worker
            span.add_event(state, event_attributes, timestamp=timestamp)
        if record.error is not None:
            self._record_error(span, record, limit)
        span.end(record.end_ns)

    @staticmethod
    def _record_error(span: trace.Span, record: _Task, limit: int) -> None:
        error = record.error or {}
        cause = error.get("cause")
        if cause is not None and cause != record.key:
            # Erred because a dependency erred: the exception belongs to that task's span.
            span.set_attribute("dask.task.erred_by", ids.cap(ids.key_to_str(cause), limit))
            span.set_status(Status(StatusCode.ERROR, "dependency erred"))
            return
        workers = record.workers or ([record.worker] if record.worker else [])
        errors.record_exception(
            span,
            error["failure"],
            limit,
            timestamp=record.end_ns,
            **({"dask.task.workers": workers} if workers else {}),
        )

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> None:
        if self._emitter is None:
            return
        self._tasks = {}  # stop recording: transitions from now on find no record
        now = time_ns()
        for graph in list(self._graphs):
            graph.span.set_attribute("dask.graph.incomplete", True)
            self._emitter.submit(graph.span.end, now)
        self._graphs.clear()
        closing, self._emitter = self._emitter, None
        self._scheduler.handlers.update(self._handlers)  # type: ignore[union-attr]
        timeout = self._settings.flush_timeout
        await asyncio.get_running_loop().run_in_executor(
            None, drain, closing, self._providers, timeout
        )
        # After the final flush, whose collection still reads this scheduler.
        metrics.forget(self._meter_provider, self._scheduler)
        logs.remove_cluster(self._cluster_id)


def _dependency_links(dependencies: Iterable[tuple[Any, Any]]) -> list[Link]:
    """Links to the ``task`` spans of dependencies that dask-otel traced."""
    links = []
    for key, annotation in dependencies:
        carrier = ids.decode(annotation)
        if carrier is None or not carrier.trace_flags.sampled:
            continue  # no span to link: scattered data, an untraced graph, a thinned task
        links.append(ids.task_link(carrier, ids.key_to_str(key), "dependency"))
    return links
