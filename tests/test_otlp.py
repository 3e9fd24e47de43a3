"""dask_otel.otlp: the OTLP request encoded from queued spans is the SDK encoder's."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from dask_otel.export import otlp_encoding, queued_spans


class Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list = []

    def on_end(self, span) -> None:
        self.spans.append(span)


def spans_of_every_shape() -> list:
    """Spans from two resources and two scopes, with every kind of field set."""
    made = []
    for resource in (Resource({"service.name": "a", "n": 1}), Resource({"service.name": "b"})):
        keep = Keep()
        provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_attributes=6))
        provider.add_span_processor(keep)
        state = TraceState([("vendor", "x1")])
        remote = SpanContext(7, 8, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
        for scope, version in (("dask_otel", "1.0"), ("user", None)):
            tracer = provider.get_tracer(scope, version)
            with tracer.start_as_current_span("root", kind=SpanKind.PRODUCER) as root:
                root.set_attribute("list", ["a", "b"])
            span = tracer.start_span(
                "task inc",
                context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
                kind=SpanKind.CLIENT,
                attributes={
                    "s": "text",
                    "b": True,
                    "i": -5,
                    "big": 2**62,
                    "f": 1.5,
                    "ints": [1, 2],
                    "floats": [0.5],
                    "bools": [True, False],
                },  # 8 attributes: 2 dropped by the limits
                links=[Link(remote, {"dask.link": "dependency"}), Link(remote)],
            )
            span.add_event("memory", {"dask.worker.address": "tcp://h:1"}, timestamp=5)
            span.add_event("bare", timestamp=6)
            span.set_status(Status(StatusCode.ERROR, "boom"))
            span.end()
            ok = tracer.start_span("ok")
            ok.set_status(Status(StatusCode.OK))
            ok.end()
        made += keep.spans
    return made


def test_the_request_is_the_sdk_encoders():
    shared = queued_spans.SharedObjects()
    spans = spans_of_every_shape()
    batch = [queued_spans.compact(span, shared) for span in spans]
    encoder = otlp_encoding.Encoder(shared.__getitem__, shared.__getitem__)
    for _ in range(2):  # the second time from its caches
        mine = ExportTraceServiceRequest.FromString(encoder.encode(batch))
        assert mine == encode_spans([queued_spans.rebuild(values, shared) for values in batch])
    assert len(mine.resource_spans) == 2
    assert [len(r.scope_spans) for r in mine.resource_spans] == [2, 2]


def test_a_lone_surrogate_costs_no_other_span():
    """The SDK's encoder fails the whole batch on one (issue 23); this one replaces it."""
    shared = queued_spans.SharedObjects()
    keep = Keep()
    provider = TracerProvider()
    provider.add_span_processor(keep)
    tracer = provider.get_tracer("t")
    for name in ("before", "caf\udce9", "after"):
        span = tracer.start_span(name, attributes={"path": f"/data/{name}.csv"})
        span.set_status(Status(StatusCode.ERROR, f"cannot parse {name}"))
        span.end()
    batch = [queued_spans.compact(span, shared) for span in keep.spans]
    with pytest.raises(UnicodeEncodeError):
        encode_spans([queued_spans.rebuild(values, shared) for values in batch])
    request = ExportTraceServiceRequest.FromString(
        otlp_encoding.Encoder(shared.__getitem__, shared.__getitem__).encode(batch)
    )
    names = [s.name for s in request.resource_spans[0].scope_spans[0].spans]
    assert names == ["before", "caf?", "after"]


def test_only_the_otlp_grpc_exporter_is_taken_over():
    shared = queued_spans.SharedObjects()
    grpc = OTLPSpanExporter(endpoint="127.0.0.1:1", insecure=True)
    try:
        assert otlp_encoding.take_over(grpc, shared.__getitem__, shared.__getitem__)
        batch = [queued_spans.compact(span, shared) for span in spans_of_every_shape()]
        assert grpc._translate_data(batch) == encode_spans(
            [queued_spans.rebuild(values, shared) for values in batch]
        )
    finally:
        grpc.shutdown()
    assert not otlp_encoding.take_over(
        ConsoleSpanExporter(), shared.__getitem__, shared.__getitem__
    )
