"""Every span and log record that leaves through dask-otel's exporters can be encoded,
and none costs its neighbours.

OTLP carries strings as UTF-8. In the SDK's encoder (OTLP/HTTP, log records), one lone
surrogate (what ``os.fsdecode`` makes of a file name's undecodable bytes) in a span's name
or status, an event's name or a log body fails the encoding of a whole batch (in an
attribute, the encoder drops that attribute and logs an error, every time); so does a
value of a type OTLP has no value for (a NumPy array), in every encoder, and an integer
beyond 64 bits. A collector refuses a request over 4 MiB, and the exporter retries it
until it gives up: a few strings of a megabyte lose their batch.

dask-otel's exporters look at each item before a batch leaves: one pass over its strings,
a fraction of what encoding it costs (``benchmarks/span_cost.py``; figures in
docs/overhead.md). Only an item
that needs it is copied: U+FFFD for each lone surrogate, the ``repr`` of a value OTLP
cannot carry, and, for an item too large for a request of its own, its strings cut
(:data:`CUTS`). A batch whose strings add up to more than :data:`REQUEST_BYTES` leaves in
several requests (and if encoding raises all the same, the exporter halves it until the
failing item is alone: ``processors.CountingExporter``). With
``otel.redact.exception-messages`` the same pass redacts the exception events and ERROR
descriptions of spans that dask-otel did not make (your own spans inside tasks, other
libraries' instrumentation) and the ``exception.*`` attributes of every log record.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk._logs import ReadableLogRecord

from dask_otel import strings
from dask_otel.export.span_fields import (
    ATTRIBUTES,
    EVENTS,
    LINK_ATTRIBUTES,
    LINKS,
    NAME,
    SCOPE,
    STATUS_CODE,
    STATUS_DESCRIPTION,
)
from dask_otel.values import SUBCLASSED, base_value

#: Estimated bytes of one request, below the 4 MiB a collector accepts over gRPC.
REQUEST_BYTES = 3 << 20
#: Bytes counted per item besides its strings (ids, times, numbers, framing).
ITEM_BYTES = 512
#: The longest string left in an item that does not fit a request as it is; then, if the
#: item is still too large (hundreds of long attributes), the longest.
CUTS = (256 << 10, 4 << 10)
#: Levels of maps and lists kept in a log body or attribute (the encoder recurses).
MAX_DEPTH = 32
#: Stands for a value nested deeper.
TOO_DEEP = "[nested too deep]"
#: What a check returns for an item that must be copied clean before it can leave.
DIRTY = -1

_INT64 = (-(1 << 63), 1 << 63)
_ERROR = 2  # StatusCode.ERROR.value, as a queued span holds it


# -- checking: the bytes of an item's strings, or DIRTY ----------------------------------


def _text_bytes(text: str) -> int:
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return DIRTY


def _value_bytes(value: Any, depth: int) -> int:
    """Bytes of the strings in an OTLP ``AnyValue``; DIRTY if the encoder would fail."""
    cls = value.__class__
    if cls is str:
        return _text_bytes(value)
    if cls is bool or cls is float or value is None:
        return 0
    if cls is int:
        return 0 if _INT64[0] <= value < _INT64[1] else DIRTY
    if cls is bytes:
        return len(value)
    if isinstance(value, SUBCLASSED):
        return _subclass_bytes(value)
    if depth >= MAX_DEPTH:
        return DIRTY
    if cls is tuple or cls is list:
        total = 0
        for item in value:
            size = _value_bytes(item, depth + 1)
            if size < 0:
                return DIRTY
            total += size
        return total
    if isinstance(value, Mapping):
        return _attributes_bytes(value, depth + 1)
    return DIRTY  # an array, an object: the encoder has no value for it


def _subclass_bytes(value: str | int | float | bytes) -> int:
    """Bytes of a subclass's value (a NumPy float, an IntEnum member, a ``str`` subclass),
    which the encoders take as their base class's: the SDK keeps them so."""
    if isinstance(value, str):
        return _text_bytes(str.__str__(value))
    if isinstance(value, int):
        return 0 if _INT64[0] <= value < _INT64[1] else DIRTY
    return len(value) if isinstance(value, bytes) else 0


def _attributes_bytes(attributes: Mapping[Any, Any] | None, depth: int = 0) -> int:
    if not attributes:
        return 0
    total = 0
    for key, value in attributes.items():
        cls = value.__class__
        if cls is str:  # the common cases first, inline
            if value.isascii() and key.isascii():
                total += len(key) + len(value)
                continue
        elif cls is int and _INT64[0] <= value < _INT64[1] and key.isascii():
            total += len(key)
            continue
        if key.__class__ is not str:
            return DIRTY
        key_size, size = _text_bytes(key), _value_bytes(value, depth)
        if key_size < 0 or size < 0:
            return DIRTY
        total += key_size + size
    return total


def _has_exception_text(attributes: Mapping[str, Any] | None) -> bool:
    """Whether an exception event's or a record's message or stack is unredacted."""
    if not attributes:
        return False
    redacted = strings.REDACTED
    return any(attributes.get(name, redacted) != redacted for name in strings.EXCEPTION_TEXT)


# -- copying clean -----------------------------------------------------------------------


class Cleaner:
    """Makes a copy of what a check found wrong: U+FFFD for lone surrogates, ``repr`` for
    values OTLP cannot carry, strings cut to ``limit``; exception text redacted when
    ``redact``."""

    def __init__(self, redact: bool, limit: int | None = None) -> None:
        self.redact = redact
        self.limit = limit

    def text(self, text: Any) -> str:
        if text.__class__ is not str:
            text = str.__str__(text) if isinstance(text, str) else strings.safe_repr(text)
        text = strings.clean(text)
        return text if self.limit is None else strings.cap(text, self.limit)

    def value(self, value: Any, depth: int = 0) -> Any:
        cls = value.__class__
        if cls is str:
            return self.text(value)
        if cls is bool or cls is float or value is None:
            return value
        if cls is int:
            return value if _INT64[0] <= value < _INT64[1] else str(value)
        if cls is bytes:
            return value if self.limit is None else value[: self.limit]
        if isinstance(value, SUBCLASSED):
            return self.value(base_value(value), depth)
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        if cls is tuple or cls is list:
            return [self.value(item, depth + 1) for item in value]
        if isinstance(value, Mapping):
            return self.attributes(value, depth + 1)
        return self.text(value)

    def attributes(self, attributes: Mapping[Any, Any] | None, depth: int = 0) -> dict | None:
        if attributes is None:
            return None
        return {self.text(k): self.value(v, depth) for k, v in attributes.items()}

    def exception(self, attributes: Mapping[str, Any] | None) -> dict | None:
        """Attributes of an exception event or log record, redacted if so configured."""
        cleaned = self.attributes(attributes)
        return strings.redact_exception_text(cleaned) if self.redact else cleaned


# -- the two kinds of item ----------------------------------------------------------------


class Spans:
    """Spans as dask-otel's processor queues them
    (:func:`dask_otel.export.queued_spans.compact`)."""

    def __init__(self, own_scope: Callable[[int], bool]) -> None:
        #: Whether a scope number is dask-otel's, whose spans redact at the source.
        self.own_scope = own_scope

    def size(self, values: tuple, redact: bool) -> int:
        name = values[NAME]
        total = len(name) if name.isascii() else _text_bytes(name)
        attributes = _attributes_bytes(values[ATTRIBUTES])
        if total < 0 or attributes < 0:
            return DIRTY
        total += attributes + ITEM_BYTES
        description = values[STATUS_DESCRIPTION]
        redacting = redact and not self.own_scope(values[SCOPE])
        if description is not None:
            size = _text_bytes(description)
            if size < 0:
                return DIRTY
            error = redacting and values[STATUS_CODE] == _ERROR
            if error and strings.redact_description(description) != description:
                return DIRTY
            total += size
        for name, _, attributes, _ in values[EVENTS]:
            size, attributes_size = _text_bytes(name), _attributes_bytes(attributes)
            if size < 0 or attributes_size < 0:
                return DIRTY
            if redacting and name == "exception" and _has_exception_text(attributes):
                return DIRTY
            total += size + attributes_size
        for link in values[LINKS]:
            size = _attributes_bytes(link[5])
            if size < 0:
                return DIRTY
            total += size
        return total

    def clean(self, values: tuple, cleaner: Cleaner) -> tuple:
        redacting = cleaner.redact and not self.own_scope(values[SCOPE])
        span = list(values)
        span[NAME] = cleaner.text(values[NAME])
        span[ATTRIBUTES] = cleaner.attributes(values[ATTRIBUTES])
        span[EVENTS] = tuple(
            (
                cleaner.text(name),
                timestamp,
                cleaner.exception(attributes)
                if redacting and name == "exception"
                else cleaner.attributes(attributes),
                dropped,
            )
            for name, timestamp, attributes, dropped in values[EVENTS]
        )
        span[LINKS] = tuple(
            (*link[:LINK_ATTRIBUTES], cleaner.attributes(link[LINK_ATTRIBUTES]), link[-1])
            for link in values[LINKS]
        )
        description = values[STATUS_DESCRIPTION]
        if description is not None:
            if redacting and values[STATUS_CODE] == _ERROR:
                description = strings.redact_description(description)
            span[STATUS_DESCRIPTION] = cleaner.text(description)
        return tuple(span)


class LogRecords:
    """The SDK's log records."""

    def size(self, readable: ReadableLogRecord, redact: bool) -> int:
        record = readable.log_record
        body = record.body
        total = _text_bytes(body) if body.__class__ is str else _value_bytes(body, 0)
        # The SDK's BoundedAttributes: its dict, read without the Mapping protocol (and its
        # lock) per key: cheaper.
        attributes = getattr(record.attributes, "_dict", record.attributes)
        attributes_size = _attributes_bytes(attributes)
        if total < 0 or attributes_size < 0:
            return DIRTY
        if redact and _has_exception_text(attributes):
            return DIRTY
        total += attributes_size + ITEM_BYTES
        for text in (record.event_name, record.severity_text):
            if text is not None:
                size = _text_bytes(text)
                if size < 0:
                    return DIRTY
                total += size
        return total

    def clean(self, readable: ReadableLogRecord, cleaner: Cleaner) -> ReadableLogRecord:
        original = readable.log_record
        record = copy.copy(original)
        record.body = cleaner.value(original.body)
        attributes = BoundedAttributes(
            attributes=cleaner.exception(original.attributes),
            immutable=False,
            extended_attributes=True,
        )
        attributes.dropped = getattr(original.attributes, "dropped", 0)
        record.attributes = attributes
        if original.event_name is not None:
            record.event_name = cleaner.text(original.event_name)
        if original.severity_text is not None:
            record.severity_text = cleaner.text(original.severity_text)
        return dataclasses.replace(readable, log_record=record)


# -- batches into requests ---------------------------------------------------------------


def requests(batch: Sequence[Any], kind: Spans | LogRecords) -> Iterator[Sequence[Any]]:
    """``batch`` as requests that can be encoded and that a collector accepts: items
    copied clean where they must be, split where their strings add up to too much."""
    redact = strings.redaction.exception_messages
    size = kind.size
    items: Sequence[Any] | list[Any] = batch
    total = 0
    for i, item in enumerate(batch):
        item_size = size(item, redact)
        if item_size < 0 or item_size > REQUEST_BYTES:
            if items is batch:
                items = list(batch)
            items[i], item_size = _fixed(item, kind, redact)  # type: ignore[index]
        total += item_size
    if total <= REQUEST_BYTES:
        yield items
        return
    start, used = 0, 0
    for i, item in enumerate(items):  # rare: sized again
        item_size = max(size(item, redact), ITEM_BYTES)
        if i > start and used + item_size > REQUEST_BYTES:
            yield items[start:i]
            start, used = i, 0
        used += item_size
    yield items[start:]


def _fixed(item: Any, kind: Spans | LogRecords, redact: bool) -> tuple[Any, int]:
    """``item`` copied clean, its strings cut until it fits a request (if they can be)."""
    fixed = kind.clean(item, Cleaner(redact))
    size = kind.size(fixed, redact)
    for limit in CUTS:
        if 0 <= size <= REQUEST_BYTES:
            break
        fixed = kind.clean(item, Cleaner(redact, limit))
        size = kind.size(fixed, redact)
    return fixed, max(size, ITEM_BYTES)
