"""Every attribute value the SDK accepts leaves dask-otel's span pipeline as the SDK's own
exporter would send it: queued as a tuple, checked (``sanitize``), encoded by
``dask_otel.export.otlp_encoding``, or written straight as a tuple (``SpanWriter``). Both requests
are decoded with opentelemetry-proto and compared field by field."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from dask_otel.export import otlp_encoding, queued_spans, sanitize, span_writer


class Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Tag(str):
    """A str subclass whose str() is not its text: the encoders send its text."""

    def __str__(self) -> str:
        return "not the text"


class Ids(IdGenerator):
    """Gives every span the id the written span gets."""

    def generate_span_id(self) -> int:
        return SPAN_ID

    def generate_trace_id(self) -> int:
        return PARENT.trace_id


SPAN_ID = 0x42
PARENT = SpanContext(0x1234, 0x5678, True, TraceFlags(TraceFlags.SAMPLED))
LINKED = SpanContext(0x1234, 0x90, False, TraceFlags(TraceFlags.SAMPLED))
#: A link the SDK keeps for what it carries, though its context is invalid.
INVALID = SpanContext(0, 0, False)

# Text the SDK's encoder can encode (a lone surrogate fails it; dask-otel replaces it).
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
# Few keys, so that spans share them with values that are equal but not the same.
keys = st.sampled_from(["a", "b", "dask.key", ""]) | text
scalars = st.one_of(
    st.booleans(),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.sampled_from([0, 1, -1, 0.0, 1.0, -0.0, True, False]),
    st.floats(),
    text,
    st.binary(max_size=8),
    st.none(),
    st.sampled_from(list(Level)),
    text.map(Tag),
    text.map(np.str_),
    st.floats().map(np.float64),
    st.integers(-100, 100).map(np.int64),
    st.booleans().map(np.bool_),
    st.integers(0, 100).map(np.float32),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(keys, inner, max_size=3)
    ),
    max_leaves=6,
)
attributes = st.dictionaries(keys, values, max_size=5)
limit = st.none() | st.integers(0, 3)
TOO_SLOW = HealthCheck.too_slow


@dataclass
class SpanSpec:
    attributes: dict
    set_later: dict
    events: list[tuple[str, dict]]
    links: list[tuple[bool, dict]]


span_specs = st.builds(
    SpanSpec,
    attributes,
    attributes,
    st.lists(st.tuples(text, attributes), max_size=2),
    st.lists(st.tuples(st.booleans(), attributes), max_size=2),
)
span_limits = st.builds(
    SpanLimits,
    max_span_attributes=limit,
    max_event_attributes=limit,
    max_link_attributes=limit,
    max_events=limit,
    max_links=limit,
    max_attribute_length=limit,
    max_span_attribute_length=limit,
)


def provider(limits: SpanLimits) -> tuple[TracerProvider, Keep]:
    made = TracerProvider(
        resource=Resource({"service.name": "t", "n": 1}), span_limits=limits, id_generator=Ids()
    )
    keep = Keep()
    made.add_span_processor(keep)
    return made, keep


def links(spec: SpanSpec) -> list[Link]:
    return [Link(LINKED if valid else INVALID, a) for valid, a in spec.links]


def sdk_span(tracer: trace.Tracer, spec: SpanSpec, number: int) -> None:
    parent = trace.set_span_in_context(trace.NonRecordingSpan(PARENT))
    span = tracer.start_span(
        f"span {number}",
        context=parent,
        kind=SpanKind.CLIENT,
        attributes=spec.attributes,
        links=links(spec),
        start_time=10,
    )
    finish(span, spec)


def written_span(writer: span_writer.SpanWriter, spec: SpanSpec, number: int) -> None:
    span = writer.start(
        SPAN_ID, f"span {number}", PARENT, SpanKind.CLIENT, 10, spec.attributes, links(spec)
    )
    finish(span, spec)


def finish(span: trace.Span, spec: SpanSpec) -> None:
    span.set_attributes(spec.set_later)
    for i, (name, event_attributes) in enumerate(spec.events):
        span.add_event(name, event_attributes, timestamp=20 + i)
    for valid, link_attributes in spec.links:
        span.add_link(LINKED if valid else INVALID, link_attributes)
    span.end(30)


def decoded(request: ExportTraceServiceRequest | bytes) -> bytes:
    """The request as decoded by opentelemetry-proto, written deterministically (NaN
    compares unequal to itself; its bytes do not)."""
    if isinstance(request, bytes):
        request = ExportTraceServiceRequest.FromString(request)
    return request.SerializeToString(deterministic=True)


def dask_otels(spans: list[ReadableSpan]) -> list[bytes]:
    """The requests dask-otel's gRPC exporter sends for ``spans``: queued, checked, encoded
    (twice: the second time from the encoder's caches)."""
    shared = queued_spans.SharedObjects()
    batch = [queued_spans.compact(span, shared) for span in spans]
    checked = [v for r in sanitize.requests(batch, sanitize.Spans(shared.is_own_scope)) for v in r]
    encoder = otlp_encoding.Encoder(shared.__getitem__, shared.__getitem__)
    return [decoded(encoder.encode(checked)) for _ in range(2)]


#: What went out changed before: equal values of three classes sharing one cache entry, a
#: mapping (the span was lost), subclasses (sent as their repr), a link's dropped count.
EXAMPLES = [
    ([SpanSpec({"a": v}, {}, [], []) for v in (1, True, 1.0, Level.LOW)], SpanLimits()),
    ([SpanSpec({}, {"m": {"x": 1, "y": [1.5, {"z": b"z"}]}}, [], [])], SpanLimits()),
    ([SpanSpec({"n": np.float64(1.5), "e": Level.HIGH, "s": Tag("t")}, {}, [], [])], SpanLimits()),
    (
        [SpanSpec({}, {}, [("e", {"a": 1, "b": 2})], [(True, {"a": 1, "b": 2})])],
        SpanLimits(max_attributes=1),
    ),
]


def over_spans(test):
    """Run ``test(specs, limits)`` on :data:`EXAMPLES` and on generated spans and limits."""
    test = given(st.lists(span_specs, min_size=1, max_size=4), span_limits)(test)
    test = settings(max_examples=300, deadline=None, suppress_health_check=[TOO_SLOW])(test)
    for specs, limits in EXAMPLES:
        test = example(specs, limits)(test)
    return test


def sdk_spans(specs: list[SpanSpec], limits: SpanLimits, scope: str) -> tuple[Keep, trace.Tracer]:
    """The SDK's spans of ``specs`` (kept), and the tracer that made them."""
    made, keep = provider(limits)
    tracer = made.get_tracer(scope, "1.0")
    for number, spec in enumerate(specs):
        sdk_span(tracer, spec, number)
    return keep, tracer


@over_spans
def test_queued_spans_encode_as_the_sdk_encodes_them(specs: list[SpanSpec], limits: SpanLimits):
    keep, _ = sdk_spans(specs, limits, "user")
    sdk = decoded(encode_spans(keep.spans))
    assert dask_otels(keep.spans) == [sdk, sdk]
    shared = queued_spans.SharedObjects()
    rebuilt = [queued_spans.rebuild(queued_spans.compact(s, shared), shared) for s in keep.spans]
    assert decoded(encode_spans(rebuilt)) == sdk


@over_spans
def test_written_spans_encode_as_the_sdk_encodes_them(specs: list[SpanSpec], limits: SpanLimits):
    keep, tracer = sdk_spans(specs, limits, "dask_otel")
    sdk, keep.spans = keep.spans, []
    writer = span_writer.span_writer(tracer)
    assert writer is not None
    for number, spec in enumerate(specs):
        written_span(writer, spec, number)
    assert dask_otels(keep.spans) == dask_otels(sdk)
    assert decoded(encode_spans(keep.spans)) == decoded(encode_spans(sdk))
