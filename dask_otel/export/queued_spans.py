"""Spans waiting for export, as one flat tuple of plain values each.

A span the SDK has ended is a dozen objects the garbage collector tracks. In a batch
queue they live long enough (until a batch is ready) to reach its oldest generation, and
every few thousand of them trigger a full collection: a walk over all of Dask's own
objects, a large part of a second on a scheduler holding a large graph. The processor
dask-otel configures queues each span as one tuple instead (the tuple is the one object
the collector tracks: its attribute dicts and everything else in it are not), and builds
the ReadableSpan again for the exporter, field for field as OTLP encodes it.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from dask_otel import runtime
from dask_otel.export.span_fields import QueuedSpan


def _trace_state_values(context: SpanContext) -> tuple | None:
    return tuple(context.trace_state.items()) if context.trace_state else None


def _trace_state(values: tuple | None) -> TraceState | None:
    return TraceState(values) if values else None


def _counted(attributes: dict | None, dropped: int) -> Any:
    """Attributes as an Event or Link reports their dropped count: from BoundedAttributes
    only (rare: only where the limits dropped some)."""
    if not dropped:
        return attributes
    bounded = BoundedAttributes(attributes=attributes)
    bounded.dropped = dropped
    return bounded


def plain_attributes(attributes: Any) -> dict | None:
    """(Already cleaned) attributes as a plain dict, which the collector does not track
    while its values are scalars or tuples of them."""
    if not attributes:
        return None
    try:
        # The SDK's BoundedAttributes (also behind the span's MappingProxyType) copies its
        # dict at C speed; ``dict()`` would go key by key through the Mapping protocol.
        return attributes.copy()
    except AttributeError:
        return dict(attributes)


class _RebuiltSpan(ReadableSpan):
    """A queued span made readable again, with the counts of what its limits dropped."""

    def __init__(self, dropped: tuple[int, int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._dropped = dropped

    @property
    def dropped_attributes(self) -> int:
        return self._dropped[0]

    @property
    def dropped_events(self) -> int:
        return self._dropped[1]

    @property
    def dropped_links(self) -> int:
        return self._dropped[2]


class SharedObjects:
    """Numbers the few resources and scopes a process has, so queued spans hold ints."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._objects: list[Any] = []
        self._lock = threading.Lock()

    def number(self, obj: Any) -> int:
        index = self._index.get(id(obj))
        if index is None:
            with self._lock:
                index = self._index.get(id(obj))
                if index is None:
                    # Kept alive with its number, so that its id is never reused.
                    index = len(self._objects)
                    self._objects.append(obj)
                    self._index[id(obj)] = index
        return index

    def __getitem__(self, index: int) -> Any:
        return self._objects[index]

    def is_own_scope(self, index: int) -> bool:
        """Whether scope ``index`` is dask-otel's (whose spans redact at the source)."""
        return getattr(self._objects[index], "name", None) == runtime.SCOPE


def compact(span: ReadableSpan, shared: SharedObjects) -> QueuedSpan:
    """``span`` as one tuple whose contents the garbage collector does not track (see
    :func:`rebuild`): one tracked object per queued span instead of a dozen."""
    return span_values(
        span.name,
        span.context,
        span.parent,
        shared.number(span.resource),
        shared.number(span.instrumentation_scope),
        span.kind,
        span.attributes,
        tuple(
            event_values(e.name, e.timestamp, e.attributes, e.dropped_attributes)
            for e in span.events
        ),
        tuple(link_values(k.context, k.attributes, k.dropped_attributes) for k in span.links),
        span.status,
        (span.start_time, span.end_time),
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
    )


def span_values(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    resource: int,
    scope: int,
    kind: SpanKind,
    attributes: Any,
    events: tuple,
    links: tuple,
    status: Status,
    times: tuple[int | None, int | None],
    dropped: tuple[int, int, int],
) -> QueuedSpan:
    """The tuple of a queued span's fields (:mod:`dask_otel.export.span_fields`)."""
    return (
        name,
        context.trace_id,
        context.span_id,
        int(context.trace_flags),
        _trace_state_values(context),
        parent.span_id if parent is not None else None,
        parent is not None and parent.is_remote,
        resource,
        scope,
        kind.value,
        plain_attributes(attributes),
        events,
        links,
        status.status_code.value,
        status.description,
        *times,
        *dropped,
    )


def event_values(name: str, timestamp: int, attributes: Any, dropped: int) -> tuple:
    """A queued event: name, timestamp, attributes, the count of attributes dropped."""
    return (name, timestamp, plain_attributes(attributes), dropped)


def link_values(context: SpanContext, attributes: Any, dropped: int) -> tuple:
    """A queued link: trace id, span id, remote flag, trace flags, trace state, attributes,
    the count of attributes dropped."""
    return (
        context.trace_id,
        context.span_id,
        context.is_remote,
        int(context.trace_flags),
        _trace_state_values(context),
        plain_attributes(attributes),
        dropped,
    )


#: Enum members by value: a dict lookup, where calling the Enum class is slow.
_SPAN_KINDS = {kind.value: kind for kind in SpanKind}
_STATUS_CODES = {code.value: code for code in StatusCode}
#: The status of almost every span, shared (a Status is immutable).
UNSET = Status(StatusCode.UNSET)
_UNSET_CODE = StatusCode.UNSET.value


def rebuild(values: QueuedSpan, shared: SharedObjects) -> ReadableSpan:
    """The ReadableSpan :func:`compact` made ``values`` of."""
    (name, trace_id, span_id, flags, trace_state, parent_id, parent_remote) = values[:7]
    (resource, scope, kind, attributes, events, links, code, description) = values[7:15]
    start, end, *dropped = values[15:]
    trace_flags = TraceFlags(flags)
    state = _trace_state(trace_state)
    status = (
        UNSET
        if code == _UNSET_CODE and description is None
        else Status(_STATUS_CODES[code], description)
    )
    return _RebuiltSpan(
        tuple(dropped),  # type: ignore[arg-type]
        name=name,
        context=SpanContext(trace_id, span_id, False, trace_flags, state),
        parent=SpanContext(trace_id, parent_id, parent_remote, trace_flags, state)
        if parent_id is not None
        else None,
        resource=shared[resource],
        instrumentation_scope=shared[scope],
        attributes=attributes or {},
        events=tuple(Event(n, _counted(a, d), t) for n, t, a, d in events),
        links=tuple(
            Link(SpanContext(t, s, r, TraceFlags(f), _trace_state(ts)), _counted(a, d))
            for t, s, r, f, ts, a, d in links
        ),
        kind=_SPAN_KINDS[kind],
        status=status,
        start_time=start,
        end_time=end,
    )
