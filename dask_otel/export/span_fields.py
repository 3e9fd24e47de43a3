"""Where each field of a queued span lies in its tuple.

A queued span is one plain tuple (:func:`dask_otel.export.queued_spans.compact` makes it,
:func:`~dask_otel.export.queued_spans.rebuild` reads it): not a named tuple, because the
garbage collector stops tracking only exact tuples whose values it does not track, and
marshal (the flight recorder's format) writes only exact tuples. These names stand for
the indexes wherever one field is read.
"""

from __future__ import annotations

#: A queued span: the fields below, in this order. (A parent shares the span's trace id;
#: OTLP sends only its span id and remote flag.)
QueuedSpan = tuple

(
    NAME,
    TRACE_ID,
    SPAN_ID,
    FLAGS,
    #: The trace state's items, or None.
    TRACE_STATE,
    #: The parent's span id (None: a root), and its remote flag.
    PARENT_ID,
    PARENT_REMOTE,
    #: The resource and the instrumentation scope, by their number in the processor's
    #: ``SharedObjects``.
    RESOURCE,
    SCOPE,
    KIND,
    ATTRIBUTES,
    #: Events as (name, timestamp, attributes, dropped attributes).
    EVENTS,
    #: Links as (trace id, span id, remote, flags, trace state, attributes, dropped).
    LINKS,
    STATUS_CODE,
    STATUS_DESCRIPTION,
    START,
    END,
    DROPPED_ATTRIBUTES,
    DROPPED_EVENTS,
    DROPPED_LINKS,
) = range(20)

#: Where the attributes lie in a queued link.
LINK_ATTRIBUTES = 5
