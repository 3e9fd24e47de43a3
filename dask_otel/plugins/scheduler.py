"""Scheduler plugin: a ``graph`` span per ``update_graph``; task spans for anomalies only.

Trace model v2: the worker that produces a task's result emits its ``task`` span, with
the deterministic id of :mod:`dask_otel.spans.ids`. The scheduler does no span work for a task
that completes normally: its hot path (``transition``, ~7 calls per task) only notes
when a graph's last task is done, and acts on the few transitions that mean something
went wrong. It emits a ``task`` span only for a task no worker finished (erred,
KilledWorker, cancelled while running) and an ``attempt`` span for an attempt lost with
its worker; each such ending moves the task to a new generation of span ids (see
:class:`dask_otel.spans.ids.Carrier`), so no id is ever emitted twice.

Each task's carrier (:class:`dask_otel.spans.ids.Carrier`) is kept here, by key, never in
the task's annotations, which are the user's: the client's context is taken out of the
``update-graph`` message before Dask reads its annotations, and a task's carrier is added
to a copy of its annotations in the ``compute-task`` message only (the worker plugin
takes it out again). Per task that is one dict entry and one dict copy per dispatch.

With ``otel.scheduler.task-spans: all`` it also records every task's lifecycle and
emits every ``task`` span, as in trace model v1 (workers then emit ``execute`` spans
under them): ~100 us of scheduler CPU per task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from contextvars import ContextVar
from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from dask_otel import runtime
from dask_otel.plugins import rpc
from dask_otel.plugins.activation import activate
from dask_otel.runtime import PLUGIN_NAME
from dask_otel.signals import events, logs, metrics
from dask_otel.spans import emitter, errors, ids, naming
from dask_otel.spans.emitter import SpanEmitter, drain, off_loop

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: States after which a task's span is complete.
FINAL_STATES = frozenset({"memory", "erred", "forgotten"})
#: States a task enters on submission, shown by its span's start rather than by events.
BEFORE_RUN = frozenset({"waiting", "queued"})
#: States a task leaves for ``released`` without a result (``erred`` was reported).
WITHOUT_RESULT = frozenset({"processing", "waiting", "queued", "no-worker"})
#: Stimuli of a task leaving ``processing`` whose attempt its worker reports itself (a
#: failure, or ``Reschedule`` raised by the task): anything else is a cancellation.
REPORTED_BY_WORKER = ("task-erred", "reschedule")
#: Stimulus of a task leaving ``processing`` because Dask turned down the result its
#: worker reported: a stale run (cancelled while running, asked for again, resumed by
#: the worker), which Dask computes again. The worker emitted that run's ``task`` span.
STALE_RESULT = "task-finished"

#: The carrier the client sent with the ``update-graph`` message being handled (Dask
#: handles a client's messages one after another, each client in a task of its own).
_submitted: ContextVar[str | None] = ContextVar("dask_otel_submitted", default=None)


class _Graph:
    """One ``update_graph`` call: its span and counts of its tasks' final states.

    The ``graph`` span is live from ``update_graph`` on (one per graph): starting it is
    how the sampler decides for the whole computation before any task reaches a worker.
    """

    __slots__ = ("carrier", "context", "counts", "pending", "span", "start_ns")

    def __init__(self, span: trace.Span, start_ns: int) -> None:
        self.span = span
        self.start_ns = start_ns
        #: What every traced task of the graph carries: the graph span's context.
        self.carrier = ids.Carrier(span.get_span_context())
        #: Tasks not yet in a final state.
        self.pending = 0
        #: Tasks by final state (and ``queued``: tasks that waited in the scheduler's queue).
        self.counts = dict.fromkeys(("memory", "erred", "forgotten", "queued"), 0)
        #: The parent context of its ``task`` spans.
        self.context = trace.set_span_in_context(trace.NonRecordingSpan(self.carrier.context))

    def end(self, now: int) -> None:
        """End the span with the counts (in the emitter thread)."""
        self.span.set_attributes({f"dask.graph.{state}": n for state, n in self.counts.items()})
        self.span.end(now)


class _Task:
    """What the scheduler knows about one task when it emits its span: the whole
    lifecycle with ``task-spans: all``, the anomaly otherwise."""

    __slots__ = (
        "attempts",
        "compute_seconds",
        "dependencies",
        "dropped_events",
        "end_ns",
        "erred_attempt",
        "error",
        "events",
        "generation",
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
        self.generation = 0
        # A graph's records live as long as its tasks: no list unless needed, and events in
        # a tuple of plain values, which Python's garbage collector stops tracking.
        self.events: tuple[tuple[str, int, str | None, str | None], ...] = ()
        self.dropped_events = 0
        #: None: unknown (a task cancelled while running).
        self.attempts: int | None = 0
        #: An attempt failed and was retried: its worker reported it, whatever the thinning.
        self.erred_attempt = False
        self.worker: str | None = None
        #: Every worker it was sent to (or died on), once each, when more than one.
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
    """Traces every graph, and the tasks no worker finished, on its scheduler."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._scheduler: Scheduler | None = None
        #: The open graph of each task not yet in a final state.
        self._tasks: dict[Any, _Graph] = {}
        #: The carrier (``otel`` annotation text) of each task traced here, until forgotten.
        self._carriers: dict[Any, str] = {}
        self._graphs: set[_Graph] = set()
        #: Open graphs by the span id their tasks carry.
        self._graph_by_span: dict[int, _Graph] = {}
        #: ``task-spans: all``: every task's lifecycle, by key.
        self._records: dict[Any, _Task] = {}
        #: Tasks whose result was released: if they run again, it is a new generation.
        self._released_results: set[Any] = set()
        #: Tasks processing on a worker being removed, reported lost, until released.
        self._lost: set[Any] = set()
        #: Workers each task died on (unexpected removals), until it ends.
        self._died_on: dict[Any, list[str]] = {}
        #: Workers a Nanny's memory monitor is killing (Dask's ``worker-restart-memory``
        #: event comes first), until removed: their lost attempts name the cause.
        self._memory_kills: dict[str, dict[str, Any]] = {}
        self._emitter: SpanEmitter | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    async def start(self, scheduler: Scheduler) -> None:
        settings = activate("scheduler", scheduler)
        if settings is None:
            return
        self._settings: Settings = settings
        self._all_task_spans = settings.scheduler_task_spans == "all"
        self._scheduler = scheduler
        self._providers = runtime.current()
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
        self._receive_graph = scheduler.stream_handlers["update-graph"]
        scheduler.stream_handlers["update-graph"] = self._update_graph_message
        self._task_message = scheduler._task_to_msg
        scheduler._task_to_msg = self._task_to_msg  # type: ignore[method-assign]

    # -- the carrier beside the annotations -----------------------------------------------

    async def _update_graph_message(self, *, annotations: Any = None, **kwargs: Any) -> None:
        """Dask's ``update-graph`` handler, given the message's global annotations without
        the client's carrier; :meth:`update_graph` finds it in ``_submitted``."""
        annotations, carrier = ids.take_carrier(annotations)
        token = _submitted.set(carrier)
        try:
            await self._receive_graph(annotations=annotations, **kwargs)
        finally:
            _submitted.reset(token)

    def _task_to_msg(self, ts: Any) -> dict[str, Any]:
        """Dask's ``compute-task`` message, with the task's carrier in a copy of its
        annotations (a worker without dask-otel keeps it there, as before)."""
        msg = self._task_message(ts)
        carrier = self._carriers.get(ts.key)
        if carrier is not None:
            annotations = msg["annotations"]
            msg["annotations"] = (
                {**annotations, ids.ANNOTATION: carrier}
                if annotations
                else {ids.ANNOTATION: carrier}
            )
        return msg

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
        submitted = ids.parse(_submitted.get())
        parent = submitted.context if submitted is not None else None
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
        graph = _Graph(span, now)
        try:
            created = self._annotate(graph, scheduler, tasks)
        except Exception:
            # Never leave the graph span open nor fail Dask's update_graph.
            logger.exception("dask-otel: tracing a graph failed")
            created = 0
        graph.pending = created
        span.set_attribute("dask.graph.tasks", created)
        if created:
            self._graphs.add(graph)
            self._graph_by_span[graph.carrier.context.span_id] = graph
        else:
            self._emitter.submit(graph.end, now)

    def _annotate(self, graph: _Graph, scheduler: Scheduler, tasks: list[Any]) -> int:
        """Give the tasks this graph created its carrier; return how many."""
        open_tasks = self._tasks
        records = self._records
        states = scheduler.tasks
        created = []
        for key in tasks:
            ts = states.get(key)
            # Only tasks this graph created are still released; the others (scattered
            # data, results of earlier graphs, running tasks) belong to other spans.
            if ts is None or ts.state != "released" or key in open_tasks:
                continue
            carrier = self._carrier(ts)
            if carrier is not None and carrier.context.span_id in self._graph_by_span:
                continue  # created by an earlier graph still open: its span lives there
            created.append(ts)
        settings = self._settings
        filtered = settings.include_prefixes or settings.exclude_prefixes
        # The prefix filters choose first; the span budget is shared by the tasks they keep.
        chosen = [not filtered or self._prefix_traced(ts.prefix.name) for ts in created]
        ratio = self._span_ratio(sum(chosen))
        partial = ratio < 1 or not all(chosen)
        carrier = graph.carrier._replace(partial=partial, scheduler_spans=self._all_task_spans)
        kept_annotation = carrier.encode()
        thinned_annotation = carrier._replace(
            context=ids.with_sampled(carrier.context, False), thinned=settings.task_spans
        ).encode()
        created_set = {ts.key for ts in created} if not self._all_task_spans else set()
        now = graph.start_ns
        for ts, kept in zip(created, chosen, strict=True):
            key_text = ids.key_to_str(ts.key)
            if kept and ratio < 1:
                kept = ids.keep_task(carrier.context, key_text, ratio)
            annotation = kept_annotation if kept else thinned_annotation
            if kept and not self._all_task_spans and ts.dependencies:
                annotation = self._with_foreign_links(carrier, ts, created_set) or annotation
            # The carrier's sampled flag tells the worker whether to trace the task.
            self._carriers[ts.key] = annotation
            open_tasks[ts.key] = graph
            if self._all_task_spans:
                records[ts.key] = _Task(ts.key, ts.prefix.name, ts.group.name, graph, now, kept)
        if ratio < 1:
            graph.span.set_attribute("dask.graph.span_ratio", ratio)
        return len(created)

    def _with_foreign_links(self, carrier: ids.Carrier, ts: Any, created: set[Any]) -> str | None:
        """The annotation naming the task spans of ``ts``'s dependencies, if one of them
        is not of this graph (the worker derives the others from their keys)."""
        dependencies = list(islice(ts.dependencies, self._settings.max_task_links))
        if all(dts.key in created for dts in dependencies):
            return None
        links = []
        for dts in dependencies:
            if dts.key in created:
                links.append(ids.TaskRef(carrier, ids.key_to_str(dts.key)).span_context)
                continue
            ref = ids.task_ref(self._carriers.get(dts.key), dts.key)
            if ref is not None:
                links.append(ref.span_context)
        return carrier._replace(links=tuple(links)).encode()

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
        if topic == "all" and isinstance(msg, dict) and msg.get("action") == "remove-worker":
            self._remove_worker(msg)
        elif topic == "worker-restart-memory" and isinstance(msg, dict):
            ws = self._scheduler.workers.get(msg.get("worker"))  # type: ignore[union-attr]
            self._memory_kills[str(msg.get("worker"))] = {
                "dask.worker.death.cause": "memory",
                "dask.worker.memory.rss_at_kill": int(msg.get("rss") or 0),
                **({"dask.worker.memory.limit": ws.memory_limit} if ws and ws.memory_limit else {}),
            }
        # Dask publishes one event under several topics (``all`` and a worker's address)
        # in one loop: gather them, export once from the background thread.
        if self._events.add(topic, msg):
            asyncio.get_running_loop().call_soon(self._flush_event)

    def _flush_event(self) -> None:
        for event in self._events.take():
            if self._emitter is not None:
                self._emitter.submit(self._events.emit, *event)

    def _remove_worker(self, msg: dict[str, Any]) -> None:
        """A worker is being removed, before its tasks are released: each task it was
        running is a lost attempt (Dask emits this event before those transitions)."""
        if self._all_task_spans:
            return  # the task spans' events show them
        worker = msg.get("worker")
        expected = bool(msg.get("expected"))
        now = time_ns()
        for key in msg.get("processing-tasks") or ():
            ts = self._scheduler.tasks.get(key)  # type: ignore[union-attr]
            # Those that died too often are erred already (KilledWorker, reported then).
            if ts is not None and ts.state == "processing":
                self._lost.add(key)
                self._lose_attempt(ts, worker, expected, now)
        self._memory_kills.pop(worker, None)

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
        if finish == "forgotten":
            self._carriers.pop(key, None)
        if self._all_task_spans:
            self._record_transition(key, start, finish, stimulus_id, kwargs)
            return
        if finish in FINAL_STATES:
            graph = self._tasks.pop(key, None)
            if finish == "erred":
                self._erred(key, start, graph, kwargs)
            elif self._died_on or self._released_results:
                self._died_on.pop(key, None)
                self._released_results.discard(key)
            if graph is not None:
                self._count(graph, finish)
        elif finish == "released":
            # Never on a normal task's path: memory -> forgotten once nobody wants it.
            if start == "memory":
                self._released_results.add(key)
            elif start in WITHOUT_RESULT:
                self._left_without_result(key, start, stimulus_id)
        elif finish == "queued":
            graph = self._tasks.get(key)
            if graph is not None:
                graph.counts["queued"] += 1
        elif self._released_results and finish == "waiting" and key in self._released_results:
            # A result lost (its worker died, say) is computed again: a new generation.
            self._released_results.discard(key)
            self._next_generation(self._scheduler.tasks.get(key))  # type: ignore[union-attr]

    def _count(self, graph: _Graph, state: str) -> None:
        graph.counts[state] += 1
        graph.pending -= 1
        if graph.pending == 0:
            self._close_graph(graph, time_ns())

    def _close_graph(self, graph: _Graph, now: int) -> None:
        self._graphs.discard(graph)
        self._graph_by_span.pop(graph.carrier.context.span_id, None)
        self._emitter.submit(graph.end, now)  # type: ignore[union-attr]

    # -- anomalies: spans for tasks no worker finished --------------------------------------

    def _erred(self, key: Any, start: str, graph: _Graph | None, kwargs: dict[str, Any]) -> None:
        """A task erred: the ``task`` span is the scheduler's to emit."""
        ts = self._scheduler.tasks.get(key)  # type: ignore[union-attr]
        carrier = self._carrier(ts)
        if carrier is None:
            return
        worker = kwargs.get("worker")
        now = time_ns()
        error = _error(ts, kwargs)
        own_failure = error["cause"] in (None, key)
        failed_attempts = _retries_used(ts)
        if start == "processing" and own_failure:
            if worker is not None and worker not in self._scheduler.workers:  # type: ignore[union-attr]
                # KilledWorker: its last attempt died with the worker being removed.
                self._lose_attempt(ts, worker, False, now)
            else:
                # The worker reported the failed attempt, under the next generation's span.
                failed_attempts += 1
                self._next_generation(ts)
            carrier = self._carrier(ts)
        elif not (carrier.context.trace_flags.sampled or carrier.generation):
            return  # thinned, never ran: nothing of it was reported, nothing to parent
        died_on = self._died_on.pop(key, [])
        record = self._anomaly(ts, carrier, graph, "erred", now)  # type: ignore[arg-type]
        record.attempts = len(died_on) + failed_attempts
        record.workers = died_on or ([worker] if worker else None)
        record.error = error
        self._emit_anomaly(ts, record)

    def _left_without_result(self, key: Any, start: str, stimulus_id: str | None) -> None:
        """A task left ``processing`` (or waiting, after attempts) without a result."""
        ts = self._scheduler.tasks.get(key)  # type: ignore[union-attr]
        carrier = self._carrier(ts)
        if carrier is None:
            return
        if key in self._lost:
            self._lost.discard(key)  # reported at the worker's removal
        elif start == "processing" and (stimulus_id or "").startswith(REPORTED_BY_WORKER):
            # A failed or rescheduled attempt, which its worker reports under the span of
            # the next generation; a retry of a thinned task is traced from now on.
            self._next_generation(ts, traced=True)
        elif start == "processing" and (stimulus_id or "").startswith(STALE_RESULT):
            self._next_generation(ts)  # the run Dask asks for now: a span id of its own
        elif start == "processing" or carrier.generation:
            # Cancelled while running, or after attempts that were reported: the span
            # they are parented to. A thinned task running had nothing reported.
            if carrier.context.trace_flags.sampled:
                record = self._anomaly(ts, carrier, None, "cancelled", time_ns())
                record.attempts = None
                self._emit_anomaly(ts, record)
            self._next_generation(ts)

    def _lose_attempt(self, ts: Any, worker: str | None, expected: bool, now: int) -> None:
        """Emit the ``attempt`` span of ``ts``'s attempt lost with ``worker`` and move the
        task to its next generation, traced (thinned or not)."""
        carrier = self._carrier(ts)
        if carrier is None:
            return
        if not expected:
            self._died_on.setdefault(ts.key, []).append(worker)  # type: ignore[arg-type]
        key = ids.key_to_str(ts.key)
        attributes = {
            **self._task_attributes(ts),
            "dask.worker.address": worker or "",
            "dask.attempt.outcome": "retired" if expected else "worker-died",
            **(self._memory_kills.get(worker, {}) if worker and not expected else {}),
        }
        if carrier.generation:
            attributes["dask.task.generation"] = carrier.generation
        self._next_generation(ts, traced=True)
        self._emitter.submit(  # type: ignore[union-attr]
            self._emit_lost_attempt, carrier, key, attributes, expected, now
        )

    def _emit_lost_attempt(
        self, carrier: ids.Carrier, key: str, attributes: dict, expected: bool, now: int
    ) -> None:
        context = ids.with_sampled(carrier.context, True)
        parent = trace.SpanContext(
            context.trace_id, carrier.next_span_id(key), True, context.trace_flags
        )
        span = self._ids.start_span(
            carrier.span_id(key),
            f"attempt {attributes['dask.task.prefix']}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            start_time=now,
            attributes=attributes,
        )
        if not expected:
            memory = "dask.worker.death.cause" in attributes
            span.set_status(Status(StatusCode.ERROR, f"worker died{_MEMORY if memory else ''}"))
        span.end(now)

    def _next_generation(self, ts: Any, traced: bool = False) -> None:
        """Move ``ts`` to its next generation of span ids (traced from now on if
        ``traced``, even if it was thinned)."""
        carrier = self._carrier(ts)
        if carrier is None:
            return
        carrier = carrier._replace(generation=carrier.generation + 1)
        if traced and not carrier.context.trace_flags.sampled:
            carrier = carrier._replace(
                context=ids.with_sampled(carrier.context, True), thinned=False
            )
        self._carriers[ts.key] = carrier.encode()

    def _carrier(self, ts: Any) -> ids.Carrier | None:
        """The carrier of a scheduler ``TaskState``, if dask-otel traces it."""
        return None if ts is None else ids.parse(self._carriers.get(ts.key))

    def _task_attributes(self, ts: Any) -> dict[str, Any]:
        limit = self._settings.max_attribute_length
        return {
            "dask.cluster.id": self._cluster_id,
            "dask.task.key": ids.cap(ids.key_to_str(ts.key), limit),
            "dask.task.prefix": ids.cap(ts.prefix.name, limit),
            "dask.task.group": ids.cap(ts.group.name, limit),
        }

    def _anomaly(
        self, ts: Any, carrier: ids.Carrier, graph: _Graph | None, state: str, now: int
    ) -> _Task:
        """The record of a task span the scheduler emits: from its graph's start (if the
        graph is still open) to now, in the task's current generation."""
        graph = graph or self._graph_by_span.get(carrier.context.span_id)
        start = graph.start_ns if graph is not None else now
        record = _Task(ts.key, ts.prefix.name, ts.group.name, graph, start, True)  # type: ignore[arg-type]
        record.generation = carrier.generation
        record.state = state
        record.end_ns = now
        return record

    def _emit_anomaly(self, ts: Any, record: _Task) -> None:
        carrier = self._carrier(ts)
        self._next_generation(ts)  # if it runs again (client.retry), under a new id
        self._emitter.submit(self._emit_task, record, carrier.context)  # type: ignore[union-attr]

    # -- task-spans: all (trace model v1) ---------------------------------------------------

    def _record_transition(
        self, key: Any, start: str, finish: str, stimulus_id: str | None, kwargs: dict[str, Any]
    ) -> None:
        record = self._records.get(key)
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
        del self._records[record.key]
        self._tasks.pop(record.key, None)
        record.state = state
        record.end_ns = now
        for startstop in kwargs.get("startstops") or ():
            if startstop.get("action") == "compute":
                record.compute_seconds += startstop["stop"] - startstop["start"]
        ts = self._scheduler.tasks.get(record.key)  # type: ignore[union-attr]
        if state == "erred":
            record.error = _error(ts, kwargs)
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
                    (dts.key, self._carriers.get(dts.key))
                    for dts in islice(ts.dependencies, settings.max_task_links)
                ]
            context = record.graph.carrier.context
            self._emitter.submit(self._emit_task, record, context)  # type: ignore[union-attr]
        self._count(record.graph, state)

    # -- emission (background thread) -----------------------------------------------------

    def _emit_task(self, record: _Task, carrier: trace.SpanContext) -> None:
        limit = self._settings.max_attribute_length
        prefix = ids.cap(record.prefix, limit)  # a key without "-" is its own prefix
        key = ids.key_to_str(record.key)
        attributes: dict[str, Any] = {
            "dask.cluster.id": self._cluster_id,
            "dask.task.key": ids.cap(key, limit),
            "dask.task.prefix": prefix,
            "dask.task.group": ids.cap(record.group, limit),
            "dask.task.state": record.state,
        }
        if record.attempts is not None:
            attributes["dask.task.attempts"] = record.attempts
        if record.worker:
            attributes["dask.worker.address"] = record.worker
        if record.workers:
            attributes["dask.task.workers"] = record.workers
        if record.nbytes is not None:
            attributes["dask.task.nbytes"] = record.nbytes
        if record.dropped_events:
            attributes["dask.task.dropped_events"] = record.dropped_events
        if record.generation:
            attributes["dask.task.generation"] = record.generation
        parent = ids.with_sampled(carrier, True)
        span = self._ids.start_span(
            ids.task_span_id(carrier, key, record.generation),
            f"task {prefix}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
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

    # -- inspection (tests, benchmarks) ------------------------------------------------------

    @property
    def settings(self) -> Settings | None:
        """The settings this plugin runs with; None before it starts or when it is off."""
        return getattr(self, "_settings", None)

    def flush(self, timeout: float) -> bool:
        """Wait until every span and event recorded so far was emitted (the emitter is
        the process's: the spans of in-process workers too); False on timeout."""
        return self._emitter is None or self._emitter.flush(timeout)

    def held(self) -> dict[str, int]:
        """What this plugin holds for work in progress: none once computations are over
        and their futures released."""
        noted = len(self._events) if self._emitter is not None else 0
        return {
            "records": len(self._tasks),
            "carriers": len(self._carriers),
            "graphs": len(self._graphs),
            "events": noted,
        }

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> None:
        if self._emitter is None:
            return
        # Stop recording: transitions from now on find no graph.
        self._tasks = {}
        self._records = {}
        self._carriers = {}
        scheduler = self._scheduler
        if scheduler.stream_handlers.get("update-graph") == self._update_graph_message:  # type: ignore[union-attr]
            scheduler.stream_handlers["update-graph"] = self._receive_graph  # type: ignore[union-attr]
        if scheduler.__dict__.get("_task_to_msg") == self._task_to_msg:  # type: ignore[union-attr]
            del scheduler._task_to_msg  # type: ignore[union-attr]
        now = time_ns()
        for graph in list(self._graphs):
            graph.span.set_attribute("dask.graph.incomplete", True)
            self._close_graph(graph, now)
        closing, self._emitter = self._emitter, None
        self._scheduler.handlers.update(self._handlers)  # type: ignore[union-attr]
        timeout = self._settings.flush_timeout
        await off_loop(drain, closing, self._providers, timeout)
        # After the final flush, whose collection still reads this scheduler.
        metrics.forget(self._meter_provider, self._scheduler)
        logs.remove_cluster(self._cluster_id)


#: How an attempt span says that the Nanny's memory monitor killed its worker.
_MEMORY = ": its Nanny terminated it over the memory limit"


def _error(ts: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Why a task erred, from its ``erred`` transition: as text now (the exception, Dask's
    own KilledWorker or a worker's pickle, is not kept until the emitter reports it), and
    the key of the task whose failure caused it."""
    cause = kwargs.get("cause")
    if cause is None and ts is not None and ts.exception_blame:
        # Dependents of a failed task are erred without kwargs; Dask blames one.
        cause = ts.exception_blame.key
    failure = errors.failure(
        kwargs.get("exception"), kwargs.get("exception_text"), kwargs.get("traceback_text")
    )
    return {"failure": failure, "cause": cause}


def _retries_used(ts: Any) -> int:
    """Attempts of ``ts`` that failed and were retried (``retries`` granted, minus left)."""
    granted = ts.annotations.get("retries") if ts.annotations else None
    return max(0, granted - ts.retries) if isinstance(granted, int) else 0


def _dependency_links(dependencies: Iterable[tuple[Any, Any]]) -> list[Link]:
    """Links to the ``task`` spans of dependencies that dask-otel traced."""
    links = []
    for key, annotation in dependencies:
        ref = ids.task_ref(annotation, key)
        if ref is not None:  # else no span to link: scattered data, untraced, thinned
            links.append(ids.task_link(ref, "dependency"))
    return links
