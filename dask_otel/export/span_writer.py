"""Spans written straight as tuples.

dask-otel builds most of its spans after the fact, from times and attributes noted on an
event loop. Through ``Tracer.start_span`` each pays for the sampler, the id generator,
the context, the SDK span's lock and bookkeeping and the processors' on_start and on_end,
and dask-otel's processor then turns it into a tuple. A SpanWriter makes that tuple
directly, for less (docs/overhead.md), with the SDK's limits; if other
processors share the provider, they get the ReadableSpan rebuilt from it (on_end: nothing
calls their on_start).
"""

from __future__ import annotations

from collections.abc import Sequence
from time import time_ns
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Tracer
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from dask_otel import strings
from dask_otel.export.processors import CompactSpanProcessor
from dask_otel.export.queued_spans import (
    UNSET,
    SharedObjects,
    event_values,
    link_values,
    rebuild,
    span_values,
)
from dask_otel.export.sdk_names import fast_path
from dask_otel.export.span_fields import QueuedSpan

#: Attribute values the SDK's cleaning keeps as they are (no length limit set).
_SCALARS = frozenset((str, bool, int, float))


def _all_plain(attributes: Any) -> bool:
    """Whether :func:`_plain` holds for every attribute (inlined: it runs for every span
    and link written)."""
    for key, value in attributes.items():
        if key.__class__ is not str or not key or value.__class__ not in _SCALARS:
            return False
    return True


def _unbounded(limit: int | None, length: int | None, count: int) -> bool:
    """Whether limits of ``limit`` attributes of ``length`` characters keep ``count`` plain
    attributes (:func:`_plain`) as they are."""
    return length is None and (limit is None or count <= limit)


def _is_valid_link(context: SpanContext | None, attributes: Any) -> bool:
    """Whether the SDK's span keeps a link: a valid context, or something else to carry."""
    return bool(context and (context.is_valid or attributes or context.trace_state))


def _plain(key: Any, value: Any) -> bool:
    """Whether the SDK keeps this attribute as it is (a valid key, a scalar value)."""
    return key.__class__ is str and bool(key) and value.__class__ in _SCALARS


class WrittenSpan(trace.Span):
    """A span that is over by the time it is made: what is done to it goes into plain
    values, and :meth:`end` hands them to its writer."""

    def __init__(
        self,
        writer: SpanWriter,
        name: str,
        context: SpanContext,
        parent: SpanContext,
        kind: SpanKind,
        start: int,
        attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> None:
        limits = writer.limits
        self._writer = writer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start = start
        #: As the SDK bounds them; a plain dict while its bounds would change nothing.
        self._attributes: dict[str, Any] | BoundedAttributes = (
            dict(attributes)
            if self._fits(len(attributes)) and _all_plain(attributes)
            else self._bounded_attributes(attributes)
        )
        self._events: list[tuple] = []
        self._dropped_events = 0
        links = [
            link
            for link in links
            if link.context.is_valid or _is_valid_link(link.context, link.attributes)
        ]
        kept = len(links) if limits.max_links is None else limits.max_links
        # As the SDK's bounded list: the latest are kept.
        kept_links = links[len(links) - kept :] if kept else []
        self._links = [self._link(link.context, link.attributes) for link in kept_links]
        self._dropped_links = len(links) - len(self._links)
        self._status = UNSET
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def _fits(self, count: int) -> bool:
        """Whether the SDK's bounds keep ``count`` plain attributes (:func:`_plain`) as they
        are: no length limit, no more than the limit. Most spans' do: cleaning each value
        was a large part of the cost of writing a span."""
        limits = self._writer.limits
        return _unbounded(limits.max_span_attributes, limits.max_span_attribute_length, count)

    def _bounded_attributes(self, attributes: Any) -> BoundedAttributes:
        limits = self._writer.limits
        return BoundedAttributes(
            limits.max_span_attributes,
            attributes,
            immutable=False,
            max_value_len=limits.max_span_attribute_length,
        )

    def set_attribute(self, key: str, value: Any) -> None:
        attributes = self._attributes
        if attributes.__class__ is dict:
            if _plain(key, value) and self._fits(len(attributes) + (key not in attributes)):
                attributes.pop(key, None)  # as the SDK's: a key set again moves to the end
                attributes[key] = value
                return
            attributes = self._attributes = self._bounded_attributes(attributes)
        attributes[key] = value

    def set_attributes(self, attributes: Any) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def _bounded(self, limit: int | None, attributes: Any) -> BoundedAttributes:
        length = self._writer.limits.max_attribute_length
        return BoundedAttributes(limit, attributes, max_value_len=length)

    def _link(self, context: SpanContext, attributes: Any) -> tuple:
        """A link as the SDK's span keeps it: its attributes bounded by the link limits,
        unless those would change nothing (dask-otel's dependency links)."""
        limits = self._writer.limits
        if not attributes or (
            _unbounded(limits.max_link_attributes, limits.max_attribute_length, len(attributes))
            and _all_plain(attributes)
        ):
            return link_values(context, attributes, 0)
        bounded = self._bounded(limits.max_link_attributes, attributes)
        return link_values(context, bounded, bounded.dropped)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        limits = self._writer.limits
        bounded = self._bounded(limits.max_event_attributes, attributes)
        timestamp = time_ns() if timestamp is None else timestamp
        event = event_values(name, timestamp, bounded, bounded.dropped)
        if limits.max_events is not None and len(self._events) >= limits.max_events:
            self._dropped_events += 1
            if not limits.max_events:
                return
            del self._events[0]  # as the SDK's bounded list: the oldest goes
        self._events.append(event)

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        limits = self._writer.limits
        if not _is_valid_link(context, attributes):
            return
        if limits.max_links is not None and len(self._links) >= limits.max_links:
            self._dropped_links += 1
            if not limits.max_links:
                return
            del self._links[0]  # as the SDK's bounded list: the oldest goes
        bounded = self._bounded(limits.max_link_attributes, attributes)
        self._links.append(link_values(context, bounded, bounded.dropped))

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # The SDK's rules: OK is final, UNSET is ignored.
        if self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Any = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event(
            "exception", strings.exception_attributes(exception, attributes, escaped), timestamp
        )

    def end(self, end_time: int | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._writer.write(self, end_time or time_ns())

    def values(self, resource: int, scope: int, end: int) -> QueuedSpan:
        """This span as :func:`compact` makes it, its resource and scope numbered so."""
        return span_values(
            self._name,
            self._context,
            self._parent if self._parent.is_valid else None,
            resource,
            scope,
            self._kind,
            self._attributes,
            tuple(self._events),
            tuple(self._links),
            self._status,
            (self._start, end),
            (getattr(self._attributes, "dropped", 0), self._dropped_events, self._dropped_links),
        )


class SpanWriter:
    """Writes :class:`WrittenSpan` s of one SDK tracer into its provider's span processor:
    straight into dask-otel's queue when that is the only processor, as ReadableSpans to
    every processor's ``on_end`` otherwise."""

    def __init__(self, tracer: Any) -> None:
        self.limits = tracer._span_limits
        self._resource = tracer.resource
        self._scope = tracer._instrumentation_scope
        #: The provider's (multi) span processor, whose processors may change.
        self._processor = tracer.span_processor
        self._shared = SharedObjects()

    def _sink(self) -> tuple[CompactSpanProcessor | None, SharedObjects]:
        """dask-otel's processor if it is the provider's only one now, and the objects
        that number resources and scopes for it."""
        processors = getattr(self._processor, "_span_processors", ())
        ours = processors[0] if len(processors) == 1 else None
        if isinstance(ours, CompactSpanProcessor):
            return ours, ours._shared
        return None, self._shared

    def start(
        self,
        span_id: int,
        name: str,
        parent: SpanContext,
        kind: SpanKind,
        start: int,
        attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> WrittenSpan:
        """A span under ``parent`` (a sampled context), with ``span_id``."""
        context = SpanContext(
            parent.trace_id, span_id, False, parent.trace_flags, parent.trace_state
        )
        return WrittenSpan(self, name, context, parent, kind, start, attributes, links)

    def write(self, span: WrittenSpan, end: int) -> None:
        ours, shared = self._sink()
        values = span.values(shared.number(self._resource), shared.number(self._scope), end)
        if ours is not None:
            ours.queue(values, self._resource, self._scope)
        else:
            self._processor.on_end(rebuild(values, shared))


def span_writer(tracer: Any) -> SpanWriter | None:
    """A :class:`SpanWriter` for an enabled SDK tracer; None for any other tracer (spans
    then go through ``start_span``: the API's path, slower), and for every tracer where the
    SDK lacks what the writer relies on."""
    if type(tracer) is not Tracer or not fast_path() or not tracer._is_enabled():
        return None
    return SpanWriter(tracer)
