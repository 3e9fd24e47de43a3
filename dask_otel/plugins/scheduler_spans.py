"""The spans the scheduler emits (``graph``, ``task`` and ``attempt``), built in the
emitter thread from plain records that its hot path fills (:class:`Graph`,
:class:`TaskRecord`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from dask_otel.spans import errors, ids

#: States after which a task's span is complete.
FINAL_STATES = frozenset({"memory", "erred", "forgotten"})
#: How an attempt span says that the Nanny's memory monitor killed its worker.
MEMORY = ": its Nanny terminated it over the memory limit"


class Graph:
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


class TaskRecord:
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
        self, key: Any, prefix: str, group: str, graph: Graph, start_ns: int, kept: bool
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


class TaskSpans:
    """Writes one scheduler's ``task`` and ``attempt`` spans, with the ids the workers
    derive too (:mod:`dask_otel.spans.ids`)."""

    def __init__(self, id_setter: ids.SpanIdSetter, cluster_id: str, limit: int) -> None:
        self._ids = id_setter
        self._cluster_id = cluster_id
        #: ``otel.max-attribute-length``.
        self._limit = limit

    def attributes(self, ts: Any) -> dict[str, Any]:
        """The attributes that name a scheduler ``TaskState``."""
        return self._identity(ids.key_to_str(ts.key), ts.prefix.name, ts.group.name)

    def _identity(self, key: str, prefix: str, group: str) -> dict[str, Any]:
        limit = self._limit
        return {
            "dask.cluster.id": self._cluster_id,
            "dask.task.key": ids.cap(key, limit),
            "dask.task.prefix": ids.cap(prefix, limit),  # a key without "-" is its own prefix
            "dask.task.group": ids.cap(group, limit),
        }

    def task(self, record: TaskRecord, carrier: trace.SpanContext) -> None:
        """Emit the ``task`` span of ``record``, a task of the graph ``carrier`` names."""
        key = ids.key_to_str(record.key)
        attributes = self._identity(key, record.prefix, record.group)
        attributes["dask.task.state"] = record.state
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
            f"task {attributes['dask.task.prefix']}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            start_time=record.start_ns,
            attributes=attributes,
            links=ids.earlier_attempt_links(carrier, key, record.generation)
            + _dependency_links(record.dependencies or ()),
        )
        for state, timestamp, stimulus_id, worker in record.events:
            event_attributes = {"dask.stimulus.id": stimulus_id} if stimulus_id else {}
            if worker:
                event_attributes["dask.worker.address"] = worker
            span.add_event(state, event_attributes, timestamp=timestamp)
        if record.error is not None:
            self._record_error(span, record)
        span.end(record.end_ns)

    def attempt(
        self,
        carrier: ids.Carrier,
        key: str,
        attributes: dict,
        expected: bool,
        times: tuple[int, int],
    ) -> None:
        """Emit the ``attempt`` span of an attempt lost with its worker (retired if
        ``expected``, else died), in ``carrier``'s generation, from ``times`` (since the
        scheduler last heard from the worker, until the loss)."""
        parent = ids.with_sampled(carrier.context, True)
        span = self._ids.start_span(
            carrier.span_id(key),
            f"attempt {attributes['dask.task.prefix']}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            start_time=times[0],
            attributes=attributes,
        )
        if not expected:
            memory = "dask.worker.death.cause" in attributes
            span.set_status(Status(StatusCode.ERROR, f"worker died{MEMORY if memory else ''}"))
        span.end(times[1])

    def _record_error(self, span: trace.Span, record: TaskRecord) -> None:
        error = record.error or {}
        cause = error.get("cause")
        if cause is not None and cause != record.key:
            # Erred because a dependency erred: the exception belongs to that task's span.
            span.set_attribute("dask.task.erred_by", ids.cap(ids.key_to_str(cause), self._limit))
            span.set_status(Status(StatusCode.ERROR, "dependency erred"))
            return
        workers = record.workers or ([record.worker] if record.worker else [])
        errors.record_exception(
            span,
            error["failure"],
            self._limit,
            timestamp=record.end_ns,
            **({"dask.task.workers": workers} if workers else {}),
        )


def failure(ts: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
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


def _dependency_links(dependencies: Iterable[tuple[Any, Any]]) -> list[Link]:
    """Links to the ``task`` spans of dependencies that dask-otel traced."""
    links = []
    for key, annotation in dependencies:
        ref = ids.task_ref(annotation, key)
        if ref is not None:  # else no span to link: scattered data, untraced, thinned
            links.append(ids.task_link(ref, "dependency"))
    return links
