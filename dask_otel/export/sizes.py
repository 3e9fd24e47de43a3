"""Estimated bytes of a queued span or log record, which bound the export queues
(:mod:`dask_otel.export.queues`): counting them exactly would cost more than the rest of
queueing."""

from __future__ import annotations

from typing import Any

from dask_otel.export.span_fields import ATTRIBUTES, EVENTS, LINKS, NAME, QueuedSpan

#: Estimated bytes of one queued span or log record: a fixed part, a part per attribute,
#: event and link, plus the characters of its strings (measured with tracemalloc on the
#: spans and records of a Dask run; see
#: ``tests/test_outage.py::test_queued_size_estimate_is_close_to_the_memory_held``).
_SPAN_BYTES, _LOG_BYTES, _ATTRIBUTE_BYTES, _EVENT_BYTES, _LINK_BYTES = 450, 900, 60, 250, 350


def _strings(attributes: Any) -> int:
    """Characters of the string values in ``attributes`` (keys are mostly shared)."""
    if not attributes:
        return 0
    return sum(len(v) for v in attributes.values() if v.__class__ is str)


def span_size(values: QueuedSpan) -> int:
    """Estimated bytes a queued span holds (see :func:`compact`)."""
    attributes, events, links = values[ATTRIBUTES], values[EVENTS], values[LINKS]
    size = _SPAN_BYTES + len(values[NAME]) + _strings(attributes)
    size += _ATTRIBUTE_BYTES * len(attributes or ())
    for _, _, event_attributes, _ in events:
        size += _EVENT_BYTES + _ATTRIBUTE_BYTES * len(event_attributes or ())
        size += _strings(event_attributes)
    return size + _LINK_BYTES * len(links)


def log_size(record: Any) -> int:
    """Estimated bytes a queued log record holds."""
    log = record.log_record
    body = log.body
    if body.__class__ is str:
        size = _LOG_BYTES + len(body)
    elif isinstance(body, dict):  # an event record: Dask's own message
        size = _LOG_BYTES + _ATTRIBUTE_BYTES * len(body) + _strings(body)
    else:
        size = _LOG_BYTES + _ATTRIBUTE_BYTES
    attributes = log.attributes
    return size + _ATTRIBUTE_BYTES * len(attributes or ()) + _strings(attributes)
