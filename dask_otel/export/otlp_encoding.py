"""OTLP encoding of queued spans, straight from their tuples.

The OTLP exporters encode each span by building protobuf message objects attribute by
attribute (``opentelemetry.exporter.otlp.proto.common``): more Python per span, on the
GIL of the process whose spans they are, than building the span. dask-otel's
span processor queues spans as tuples of plain values
(:func:`dask_otel.export.queued_spans.compact`); this module writes the protobuf wire
format of an ``ExportTraceServiceRequest`` from those tuples directly, caching what
repeats from span to span (attribute keys, the attributes every span of a worker
carries, resources and scopes). The bytes are the same message the SDK's encoder
builds: the tests compare them field by field.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dask_otel.export.span_fields import RESOURCE, SCOPE, QueuedSpan

#: A queued span (see :func:`dask_otel.export.queued_spans.compact`).

_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack
_pack_double = struct.Struct("<d").pack

#: OTLP's SpanFlags: the parent's (or link's) remote flag is known, and is set.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
#: Encoded (key, value) pairs kept per value class: the attributes that repeat from span
#: to span (the cluster, the worker, the prefix).
MAX_CACHED = 4096
#: The value classes whose pairs are cached, each in a cache of its own: ``True``, ``1``
#: and ``1.0`` are equal keys of one dict, and encode differently. Any other class (a
#: float, a subclass, a tuple, a mapping) is encoded every time.
_CACHED = (str, int, bool)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _text(value: str) -> bytes:
    # A lone surrogate (a non-UTF-8 file name) must not fail the whole request. Through
    # str's own method: a subclass's text is its characters, as protobuf encodes it.
    return str.encode(value, "utf-8", "replace")


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s fields."""
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, str):
        return _field(b"\x0a", _text(value))
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", pairs)
    if value is None:
        return b""
    raise TypeError(f"cannot encode {type(value).__name__} as an OTLP value")


def _key_value(key: str, value: Any) -> bytes:
    return _field(b"\x0a", _text(key)) + _field(b"\x12", _any_value(value))


class Encoder:
    """Encodes batches of queued spans as one ``ExportTraceServiceRequest``.

    ``resource`` and ``scope`` map the numbers a queued span holds to the SDK's Resource
    and InstrumentationScope. One encoder per exporter: its caches are not shared
    between threads.
    """

    def __init__(self, resource: Callable[[int], Any], scope: Callable[[int], Any]) -> None:
        self._resource = resource
        self._scope = scope
        #: Encoded attributes, by the tag of the field that holds them, then by value class.
        self._pairs: dict[bytes, dict[type, dict[tuple[str, Any], bytes]]] = {}
        self._headers: dict[int, bytes] = {}

    def encode(self, batch: Sequence[QueuedSpan]) -> bytes:
        """The request's bytes: spans grouped by resource, then by scope."""
        groups: dict[int, dict[int, list[bytes]]] = {}
        for values in batch:
            groups.setdefault(values[RESOURCE], {}).setdefault(values[SCOPE], []).append(
                _field(b"\x12", self._span(values))
            )
        out = []
        for resource, scopes in groups.items():
            body = [self._resource_header(resource)]
            for scope, spans in scopes.items():
                body.append(_field(b"\x12", self._scope_header(scope) + b"".join(spans)))
            schema = getattr(self._resource(resource), "schema_url", "")
            if schema:
                body.append(_field(b"\x1a", _text(schema)))
            out.append(_field(b"\x0a", b"".join(body)))
        return b"".join(out)

    def _resource_header(self, number: int) -> bytes:
        """``ResourceSpans.resource``."""
        key = 2 * number
        header = self._headers.get(key)
        if header is None:
            resource = self._resource(number)
            header = self._headers[key] = _field(
                b"\x0a", self._attributes(b"\x0a", resource.attributes)
            )
        return header

    def _scope_header(self, number: int) -> bytes:
        """``ScopeSpans.scope`` (and its schema URL)."""
        key = 2 * number + 1
        header = self._headers.get(key)
        if header is None:
            scope = self._scope(number)
            fields = b""
            if scope is not None:
                fields = _field(b"\x0a", _text(scope.name)) if scope.name else b""
                if scope.version:
                    fields += _field(b"\x12", _text(scope.version))
                fields += self._attributes(b"\x1a", scope.attributes)
            header = _field(b"\x0a", fields)
            if scope is not None and scope.schema_url:
                header += _field(b"\x1a", _text(scope.schema_url))
            self._headers[key] = header
        return header

    def _attributes(self, tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
        if not attributes:
            return b""
        caches = self._pairs.get(tag)
        if caches is None:
            caches = self._pairs[tag] = {cls: {} for cls in _CACHED}
        out = []
        for item in attributes.items():
            pairs = caches.get(item[1].__class__)
            if pairs is None:
                out.append(_field(tag, _key_value(*item)))
                continue
            encoded = pairs.get(item)
            if encoded is None:
                encoded = _field(tag, _key_value(*item))
                if len(pairs) < MAX_CACHED:
                    pairs[item] = encoded
            out.append(encoded)
        return b"".join(out)

    def _span(self, values: QueuedSpan) -> bytes:
        (name, trace_id, span_id, _, trace_state, parent_id, parent_remote) = values[:7]
        (kind, attributes, events, links, code, description) = values[9:15]
        start, end, dropped_attributes, dropped_events, dropped_links = values[15:]
        trace_bytes = trace_id.to_bytes(16, "big")
        out = [b"\x0a\x10", trace_bytes, b"\x12\x08", span_id.to_bytes(8, "big")]
        if trace_state:
            out.append(_field(b"\x1a", _text(",".join(f"{k}={v}" for k, v in trace_state))))
        if parent_id is not None:
            out += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        out += (_field(b"\x2a", _text(name)), b"\x30", _varint(kind + 1))
        out += (b"\x39", _pack_fixed64(start), b"\x41", _pack_fixed64(end))
        out.append(self._attributes(b"\x4a", attributes))
        if dropped_attributes:
            out += (b"\x50", _varint(dropped_attributes))
        for event_name, timestamp, event_attributes, event_dropped in events:
            event = b"\x09" + _pack_fixed64(timestamp) + _field(b"\x12", _text(event_name))
            event += self._attributes(b"\x1a", event_attributes)
            if event_dropped:
                event += b"\x20" + _varint(event_dropped)
            out.append(_field(b"\x5a", event))
        if dropped_events:
            out += (b"\x60", _varint(dropped_events))
        for link in links:
            out.append(_field(b"\x6a", self._link(*link)))
        if dropped_links:
            out += (b"\x70", _varint(dropped_links))
        status = _field(b"\x12", _text(description)) if description else b""
        out.append(_field(b"\x7a", status + (b"\x18" + _varint(code) if code else b"")))
        span_flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent_remote else 0)
        out += (b"\x85\x01", _pack_fixed32(span_flags))
        return b"".join(out)

    def _link(
        self,
        trace_id: int,
        span_id: int,
        remote: bool,
        _flags: int,
        _trace_state: tuple | None,
        attributes: dict | None,
        dropped_attributes: int,
    ) -> bytes:
        # No trace state: the SDK's encoder (1.45) sends none for links either.
        out = b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")
        out += self._attributes(b"\x22", attributes)
        if dropped_attributes:
            out += b"\x28" + _varint(dropped_attributes)
        return out + b"\x35" + _pack_fixed32(_HAS_IS_REMOTE | (_IS_REMOTE if remote else 0))


def take_over(exporter: Any, resource: Callable[[int], Any], scope: Callable[[int], Any]) -> bool:
    """Make ``exporter`` (if it is the OTLP/gRPC span exporter) encode batches of queued
    spans with an :class:`Encoder`; False (nothing changed) for any other exporter, which
    then gets ReadableSpans as usual.

    The gRPC exporter turns a batch into its request in one method (``_translate_data``,
    called once per attempt, retries included); everything else (channel, retries,
    timeouts, headers, compression) stays the exporter's own.
    """
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError:
        return False
    if type(exporter) is not OTLPSpanExporter or not hasattr(exporter, "_translate_data"):
        return False
    encoder = Encoder(resource, scope)

    def translate(batch: Sequence[QueuedSpan]) -> Any:
        return ExportTraceServiceRequest.FromString(encoder.encode(batch))

    exporter._translate_data = translate
    return True
