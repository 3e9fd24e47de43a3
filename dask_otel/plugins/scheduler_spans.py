"""The spans the scheduler emits (``graph``, ``task`` and ``attempt``), built in the
emitter thread from plain records that its hot path fills (:class:`Graph`,
:class:`TaskRecord`)."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dask_otel import strings
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
    """What the scheduler knows about a task no worker finished when it emits its span."""

    __slots__ = (
        "attempts",
        "end_ns",
        "error",
        "generation",
        "group",
        "key",
        "prefix",
        "start_ns",
        "state",
        "workers",
    )

    def __init__(self, key: Any, prefix: str, group: str, start_ns: int) -> None:
        self.key = key
        self.prefix = prefix
        self.group = group
        self.start_ns = start_ns
        self.end_ns = 0
        self.generation = 0
        #: Failed and lost attempts; None: unknown (a task cancelled while running).
        self.attempts: int | None = 0
        #: The workers it died on, or that of its last failure.
        self.workers: list[str] | None = None
        #: ``erred`` or ``cancelled``.
        self.state = ""
        self.error: dict[str, Any] | None = None


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
        return self._identity(strings.key_to_str(ts.key), ts.prefix.name, ts.group.name)

    def _identity(self, key: str, prefix: str, group: Any) -> dict[str, Any]:
        limit = self._limit
        return {
            "dask.cluster.id": self._cluster_id,
            "dask.task.key": strings.cap(key, limit),
            "dask.task.prefix": strings.cap(prefix, limit),  # a key without "-" is its own prefix
            # A tuple key's group is its first element, of any key type (an int, a tuple).
            "dask.task.group": strings.cap(strings.key_to_str(group), limit),
        }

    def task(self, record: TaskRecord, carrier: trace.SpanContext) -> None:
        """Emit the ``task`` span of ``record``, a task of the graph ``carrier`` names."""
        key = strings.key_to_str(record.key)
        attributes = self._identity(key, record.prefix, record.group)
        attributes["dask.task.state"] = record.state
        if record.attempts is not None:
            attributes["dask.task.attempts"] = record.attempts
        if record.workers:
            attributes["dask.task.workers"] = record.workers
        if record.generation:
            attributes["dask.task.generation"] = record.generation
        parent = ids.with_sampled(carrier, True)
        span = self._ids.start_span(
            ids.task_span_id(carrier, key, record.generation),
            f"task {attributes['dask.task.prefix']}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            start_time=record.start_ns,
            attributes=attributes,
            links=ids.earlier_attempt_links(carrier, key, record.generation),
        )
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
            span.set_attribute(
                "dask.task.erred_by", strings.cap(strings.key_to_str(cause), self._limit)
            )
            span.set_status(Status(StatusCode.ERROR, "dependency erred"))
            return
        workers = record.workers or []
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
