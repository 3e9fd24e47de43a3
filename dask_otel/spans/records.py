"""Spans recorded on the event loop now and built by the SDK later, off the loop.

A task attempt's span must be current while its task runs: user spans nest under it,
user log records carry its ids, ``rpc`` spans see a recording parent, and user code may
``set_attribute`` on it. Building it through the SDK on the worker's event loop, Dask's
bottleneck, would cost tens of times what a :class:`DeferredSpan` does: it
gets its span id when first asked (children and log records name their parent; most
tasks have neither, and the emitter asks off the loop), keeps whatever is done to it as
calls, and :meth:`DeferredSpan.replay` applies them to the real span, made with the same
id in a background thread once the task is over. :class:`EndedSpans` builds them, and
the spans of other work over by then (transfers, spills, requests), from times and
attributes: written straight as the tuple dask-otel's span processor queues for the
SDK's tracers (:func:`dask_otel.export.span_writer.span_writer`, which the plugins hand over),
through ``start_span`` with :class:`dask_otel.spans.ids.SpanIdSetter` for any other.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from time import time_ns
from typing import Any

from opentelemetry import trace
from opentelemetry.util import types

from dask_otel import strings
from dask_otel.spans import emitter, errors, ids
from dask_otel.spans.emitter import SpanEmitter

#: Calls kept per span (the SDK keeps at most 128 attributes, events and links anyway):
#: user code calling ``set_attribute`` in a loop must not grow a task's memory.
MAX_CALLS = 512


class DeferredSpan(trace.Span):
    """A recording span, its id drawn once when first asked, whose operations are replayed
    on a real span.

    Its parent is given when the real span is started; only its trace id and flags are
    known here (the parent's). Time-stamped operations (events, exceptions) keep the time
    they were made. ``end`` is ignored: the span ends when the task attempt does.
    """

    __slots__ = ("_calls", "_context", "_ended_ns", "_parent")

    def __init__(self, parent: trace.SpanContext) -> None:
        self._parent = parent
        #: Drawn on the first ``get_span_context``.
        self._context: trace.SpanContext | None = None
        #: Made on the first call: most tasks never touch their span.
        self._calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] | None = None
        #: When the owner's work ended (ns), once it has.
        self._ended_ns: int | None = None

    def ended(self, end_ns: int) -> None:
        """The owner's work (the task attempt, the fetch) ended at ``end_ns``."""
        self._ended_ns = end_ns

    def outlived_by(self, end_ns: int) -> trace.SpanContext | None:
        """Where a span that began under this one but ends at ``end_ns``, after it, goes
        (this span's parent: a child never outlasts its parent), or None if it fits."""
        ended = self._ended_ns
        return self._parent if ended is not None and end_ns > ended else None

    def _keep(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self._calls is None:
            self._calls = []
        if len(self._calls) < MAX_CALLS:
            self._calls.append((name, args, kwargs))

    def replay(self, span: trace.Span) -> None:
        """Apply to ``span`` everything done to this one, in order."""
        for name, args, kwargs in self._calls or ():
            getattr(span, name)(*args, **kwargs)

    def get_span_context(self) -> trace.SpanContext:
        context = self._context
        if context is None:
            parent = self._parent
            context = self._context = trace.SpanContext(
                parent.trace_id,
                self._new_span_id(),
                is_remote=False,
                trace_flags=parent.trace_flags,
                trace_state=parent.trace_state,
            )
        return context

    def _new_span_id(self) -> int:
        return random.getrandbits(64) or 1  # as the SDK's RandomIdGenerator draws them

    def is_recording(self) -> bool:
        return True

    def end(self, end_time: int | None = None) -> None:
        """Ignored: the owner ends the real span."""

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        self._keep("set_attributes", dict(attributes))

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        self._keep("set_attribute", key, value)

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        if name == "exception" and strings.redaction.exception_messages:
            attributes = strings.redact_exception_text(attributes)
        self._keep("add_event", name, attributes, timestamp or time_ns())

    def add_link(self, context: trace.SpanContext, attributes: types.Attributes = None) -> None:
        self._keep("add_link", context, attributes)

    def update_name(self, name: str) -> None:
        self._keep("update_name", name)

    def set_status(
        self, status: trace.Status | trace.StatusCode, description: str | None = None
    ) -> None:
        if strings.redaction.exception_messages:  # ``use_span`` describes the exception
            status, description = strings.redact_status(status, description)
        self._keep("set_status", status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The SDK's ``exception`` event, made now: the exception and its frames (the
        task's data) are not kept until the span is built. Redacted as dask-otel's own
        (``otel.redact.exception-messages``)."""
        event = strings.exception_attributes(exception, attributes, escaped)
        self.add_event("exception", event, timestamp)

    def __repr__(self) -> str:
        return f"DeferredSpan({self.get_span_context()!r})"


class TaskAttemptSpan(DeferredSpan):
    """The span current while a task attempt runs: its id is the task's span id in the
    attempt's generation (:meth:`dask_otel.spans.ids.Carrier.span_id`), computed when first
    asked, so that the span can be emitted as the ``task`` span or as an ``attempt``."""

    __slots__ = ("_carrier", "_key")

    def __init__(self, carrier: ids.Carrier, key: Any) -> None:
        super().__init__(carrier.context)
        self._carrier = carrier
        self._key = key

    def _new_span_id(self) -> int:
        return self._carrier.span_id(strings.key_to_str(self._key))


class EndedSpans:
    """Spans of work that is over by the time they are built (a task attempt run, data
    sent to or fetched from a peer, a key spilled or read back, a request answered): the
    event loop keeps times and a dict (and the :class:`DeferredSpan` that was current, if
    something could nest under it), and the SDK builds the span in an emitter's thread."""

    def __init__(
        self, tracer: trace.Tracer, emitter: SpanEmitter, limit: int, writer: Any = None
    ) -> None:
        self._ids = ids.SpanIdSetter(tracer)
        #: Writes the spans of the OpenTelemetry SDK's tracers as the tuples its span
        #: processor queues, skipping ``start_span`` (``dask_otel.export.span_writer.span_writer``
        #: of ``tracer``); None: through ``start_span``, as for any other tracer.
        self._writer = writer
        #: The thread that builds them; the owner may submit other work to it.
        self.emitter = emitter
        self._limit = limit

    @property
    def direct(self) -> bool:
        """Whether spans are written as the SDK's queued tuples (an SDK tracer) rather
        than started through the API (any other tracer)."""
        return self._writer is not None

    def submit(self, *span: Any) -> None:
        """:meth:`build` ``span`` in the emitter's thread, after what was submitted before.
        Its error is reduced to text here: it holds the frames of the work that failed."""
        error = span[5]
        if error is not None:
            span = (*span[:5], errors.failure(error), *span[6:])
        self.emitter.submit(self.build, *span)

    def build(
        self,
        name: str,
        parent: trace.SpanContext | ids.TaskRef,
        kind: trace.SpanKind,
        times: tuple[int, int],
        attributes: dict[str, Any],
        error: errors.Failure | None,
        links: list[ids.TaskRef] | list[trace.Link] | None = None,
        deferred: DeferredSpan | None = None,
        final: dict[str, Any] | None = None,
        span_id: int | None = None,
    ) -> None:
        """A span ``name`` from ``times`` (start, end) under ``parent``: a span's context
        (invalid: a root), or a task whose span is the parent. ``error`` makes it an ERROR
        span with its ``exception``. ``links``: other tasks' spans it served, or links.
        ``deferred``: the span that was current meanwhile, whose id (unless ``span_id`` is
        given) and recorded calls it takes. ``final``: attributes set after those calls, so
        user code cannot change them."""
        if span_id is None and deferred is not None:
            span_id = deferred.get_span_context().span_id
        context = parent if isinstance(parent, trace.SpanContext) else parent.span_context
        all_links = [
            link if isinstance(link, trace.Link) else ids.task_link(link, "served")
            for link in links or ()
        ]
        span: trace.Span
        if self._writer is not None and context.trace_flags.sampled:
            span = self._writer.start(
                span_id or random.getrandbits(64) or 1,
                name,
                context,
                kind,
                times[0],
                attributes,
                all_links,
            )
        else:  # another SDK's tracer, or a root: through the API
            span = self._ids.start_span(
                span_id,
                name,
                context=trace.set_span_in_context(trace.NonRecordingSpan(context)),
                kind=kind,
                start_time=times[0],
                attributes=attributes,
                links=all_links,
            )
        if deferred is not None:
            deferred.replay(span)
        if final:
            span.set_attributes(final)
        if error is not None:
            errors.record_exception(span, error, self._limit, timestamp=times[1])
        span.end(times[1])


def ended_spans(tracer: trace.Tracer, max_attribute_length: int) -> EndedSpans:
    """Builds spans of work that is over (``rpc`` spans, a worker's) with ``tracer`` in
    this process's emitter thread (a request does not say which client, scheduler or
    worker of the process sent it), written straight as queued tuples for SDK tracers."""
    try:
        from dask_otel.export import span_writer  # imports the SDK: not at import time
    except ImportError:  # no SDK installed: spans go through the API
        writer = None
    else:
        writer = span_writer.span_writer(tracer)
    return EndedSpans(tracer, emitter.shared(), max_attribute_length, writer)
