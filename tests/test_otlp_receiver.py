"""The test OTLP receiver works end to end with the real OpenTelemetry SDK exporters."""

from __future__ import annotations

import gzip
import logging
import urllib.error
import urllib.request

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
    OTLPLogExporter as GrpcLogExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import (
    OTLPLogExporter as HttpLogExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.instrumentation.logging.handler import LoggingHandler
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from otlp_receiver import OTLPReceiver, any_value_to_python

RESOURCE = Resource.create({"service.name": "otlp-receiver-test"})
PARENT_ATTRIBUTES = {"dask.key": "x-1", "n": 3, "ratio": 0.5, "tags": ["a", "b"]}


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _emit_spans(exporter: SpanExporter) -> tuple[trace.SpanContext, trace.SpanContext]:
    """Export a parent and a child span through ``exporter``; return their contexts."""
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    try:
        tracer = provider.get_tracer("test.scope")
        with (
            tracer.start_as_current_span("parent", attributes=PARENT_ATTRIBUTES) as parent,
            tracer.start_as_current_span("child", kind=trace.SpanKind.CLIENT) as child,
        ):
            child.add_event("stolen", {"victim": "w1", "flag": True})
            child.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
    return parent.get_span_context(), child.get_span_context()


def _assert_spans(
    rx: OTLPReceiver, parent_ctx: trace.SpanContext, child_ctx: trace.SpanContext
) -> None:
    rx.wait_for(lambda r: len(r.spans()) >= 2, timeout=10)
    [parent] = rx.spans(name="parent")
    [child] = rx.spans(name="child")

    assert parent["trace_id"] == _hex(parent_ctx.trace_id, 32)
    assert parent["span_id"] == _hex(parent_ctx.span_id, 16)
    assert parent["parent_span_id"] is None
    assert parent["attributes"] == PARENT_ATTRIBUTES
    assert parent["kind"] == 1  # SPAN_KIND_INTERNAL
    assert parent["start_ns"] <= child["start_ns"] <= child["end_ns"] <= parent["end_ns"]
    assert parent["resource"]["service.name"] == "otlp-receiver-test"
    assert parent["scope"] == "test.scope"

    assert child["trace_id"] == parent["trace_id"] == _hex(child_ctx.trace_id, 32)
    assert child["span_id"] == _hex(child_ctx.span_id, 16)
    assert child["parent_span_id"] == parent["span_id"]
    assert child["kind"] == 3  # SPAN_KIND_CLIENT
    assert [(e["name"], e["attributes"]) for e in child["events"]] == [
        ("stolen", {"victim": "w1", "flag": True})
    ]
    assert child["events"][0]["time_ns"] > 0
    assert (child["status_code"], child["status_message"]) == (2, "boom")  # STATUS_CODE_ERROR


def _emit_logs(exporter: LogRecordExporter) -> trace.SpanContext:
    """Log twice through ``LoggingHandler`` (inside a span, then outside); return span ctx."""
    provider = LoggerProvider(resource=RESOURCE)
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    handler = LoggingHandler(logger_provider=provider)
    logger = logging.getLogger("test.otlp_receiver.logs")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    tracer = TracerProvider().get_tracer("test")
    try:
        with tracer.start_as_current_span("logging-span") as span:
            logger.warning(
                "hello %s", "world", extra={"dask.worker": "w1", "otel.event.name": "dask.hello"}
            )
        logger.info("outside")
        assert provider.force_flush(10_000)
    finally:
        logger.removeHandler(handler)
        provider.shutdown()
    return span.get_span_context()


def _assert_logs(rx: OTLPReceiver, span_ctx: trace.SpanContext) -> None:
    rx.wait_for(lambda r: len(r.log_records()) >= 2, timeout=10)
    inside, outside = rx.log_records()
    assert inside["body"] == "hello world"
    assert (inside["severity_number"], inside["severity_text"]) == (13, "WARN")
    assert inside["trace_id"] == _hex(span_ctx.trace_id, 32)
    assert inside["span_id"] == _hex(span_ctx.span_id, 16)
    assert inside["attributes"]["dask.worker"] == "w1"
    assert inside["event_name"] == "dask.hello"
    assert inside["scope"] == "test.otlp_receiver.logs"
    assert inside["resource"]["service.name"] == "otlp-receiver-test"
    assert inside["time_ns"] > 0

    assert outside["body"] == "outside"
    assert (outside["severity_number"], outside["severity_text"]) == (9, "INFO")
    assert outside["trace_id"] is None
    assert outside["span_id"] is None
    assert outside["event_name"] == ""


def _emit_metrics(exporter: MetricExporter) -> None:
    """Record a counter, a histogram and a gauge and export them once."""
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    try:
        meter = provider.get_meter("test.meter")
        counter = meter.create_counter("dask.tasks", unit="{task}", description="tasks")
        counter.add(3, {"state": "memory"})
        counter.add(2, {"state": "memory"})
        histogram = meter.create_histogram(
            "dask.duration", unit="s", explicit_bucket_boundaries_advisory=[1.0, 10.0, 100.0]
        )
        histogram.record(5.0)
        histogram.record(50.0)
        meter.create_gauge("dask.workers").set(4)
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()


def _assert_metrics(rx: OTLPReceiver) -> None:
    rx.wait_for(lambda r: r.metrics(name="dask.duration"), timeout=10)
    counter = rx.metrics(name="dask.tasks")[0]
    assert counter["type"] == "sum"
    assert counter["value"] == 5
    assert counter["unit"] == "{task}"
    assert counter["attributes"] == {"state": "memory"}
    assert counter["is_monotonic"] is True
    assert counter["scope"] == "test.meter"
    assert counter["resource"]["service.name"] == "otlp-receiver-test"
    assert counter["time_ns"] > 0

    histogram = rx.metrics(name="dask.duration")[0]
    assert histogram["type"] == "histogram"
    assert histogram["unit"] == "s"
    value = histogram["value"]
    assert (value["count"], value["sum"], value["min"], value["max"]) == (2, 55.0, 5.0, 50.0)
    assert value["explicit_bounds"] == [1.0, 10.0, 100.0]
    assert value["bucket_counts"] == [0, 1, 1, 0]

    gauge = rx.metrics(name="dask.workers")[0]
    assert (gauge["type"], gauge["value"]) == ("gauge", 4)


# ----------------------------------------------------------------------------- gRPC


def test_traces_grpc(receiver: OTLPReceiver) -> None:
    parent_ctx, child_ctx = _emit_spans(
        GrpcSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True)
    )
    _assert_spans(receiver, parent_ctx, child_ctx)
    assert receiver.requests.get(("grpc", "traces"), 0) >= 1


def test_logs_grpc(receiver: OTLPReceiver) -> None:
    span_ctx = _emit_logs(GrpcLogExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    _assert_logs(receiver, span_ctx)
    assert receiver.requests.get(("grpc", "logs"), 0) >= 1


def test_metrics_grpc(receiver: OTLPReceiver) -> None:
    _emit_metrics(GrpcMetricExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    _assert_metrics(receiver)
    assert receiver.requests.get(("grpc", "metrics"), 0) >= 1


# ----------------------------------------------------------------------------- HTTP


def test_traces_http_gzip(receiver: OTLPReceiver) -> None:
    exporter = HttpSpanExporter(
        endpoint=f"{receiver.http_endpoint}/v1/traces", compression=Compression.Gzip
    )
    parent_ctx, child_ctx = _emit_spans(exporter)
    _assert_spans(receiver, parent_ctx, child_ctx)
    assert set(receiver.requests) == {("http", "traces")}


def test_logs_http(receiver: OTLPReceiver) -> None:
    span_ctx = _emit_logs(HttpLogExporter(endpoint=f"{receiver.http_endpoint}/v1/logs"))
    _assert_logs(receiver, span_ctx)
    assert set(receiver.requests) == {("http", "logs")}


def test_metrics_http(receiver: OTLPReceiver) -> None:
    _emit_metrics(HttpMetricExporter(endpoint=f"{receiver.http_endpoint}/v1/metrics"))
    _assert_metrics(receiver)
    assert set(receiver.requests) == {("http", "metrics")}


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_http_protocol_details(receiver: OTLPReceiver) -> None:
    body = ExportTraceServiceRequest().SerializeToString()
    protobuf = {"Content-Type": "application/x-protobuf"}

    status, content_type, reply = _post(
        f"{receiver.http_endpoint}/v1/traces",
        gzip.compress(body),
        {**protobuf, "Content-Encoding": "gzip"},
    )
    assert (status, content_type) == (200, "application/x-protobuf")
    assert ExportTraceServiceResponse.FromString(reply) == ExportTraceServiceResponse()
    assert receiver.requests == {("http", "traces"): 1}

    assert _post(f"{receiver.http_endpoint}/v1/nope", body, protobuf)[0] == 404
    assert (
        _post(f"{receiver.http_endpoint}/v1/traces", b"{}", {"Content-Type": "text/json"})[0] == 415
    )
    assert _post(f"{receiver.http_endpoint}/v1/traces", b"\xff\xff", protobuf)[0] == 400
    assert receiver.requests == {("http", "traces"): 1}


# ----------------------------------------------------------------------------- receiver API


def test_any_value_decoding() -> None:
    value = AnyValue(
        kvlist_value=KeyValueList(
            values=[
                KeyValue(key="s", value=AnyValue(string_value="x")),
                KeyValue(key="b", value=AnyValue(bytes_value=b"\x00\x01")),
                KeyValue(
                    key="arr",
                    value=AnyValue(
                        array_value=ArrayValue(
                            values=[
                                AnyValue(int_value=1),
                                AnyValue(double_value=2.5),
                                AnyValue(bool_value=False),
                                AnyValue(),
                            ]
                        )
                    ),
                ),
            ]
        )
    )
    assert any_value_to_python(value) == {"s": "x", "b": b"\x00\x01", "arr": [1, 2.5, False, None]}
    assert any_value_to_python(AnyValue()) is None


def test_wait_for_clear_and_stop(receiver: OTLPReceiver) -> None:
    _emit_spans(GrpcSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    assert receiver.wait_for(lambda r: r.spans(name="child"), timeout=10)[0]["name"] == "child"

    with pytest.raises(AssertionError, match=r"2 spans.*'child', 'parent'.*IndexError"):
        receiver.wait_for(lambda r: r.spans(name="missing")[0], timeout=0.2, poll=0.05)

    receiver.clear()
    assert (receiver.spans(), receiver.log_records(), receiver.metrics(), receiver.requests) == (
        [],
        [],
        [],
        {},
    )
    receiver.stop()
    receiver.stop()  # idempotent


def test_drain_takes_what_arrived_once(receiver: OTLPReceiver) -> None:
    _emit_spans(GrpcSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    _emit_logs(GrpcLogExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    receiver.wait_for(lambda r: r.spans(name="child") and r.log_records(), timeout=10)

    spans, logs, points = receiver.drain()
    assert sorted(s["name"] for s in spans) == ["child", "parent"]
    assert len(logs) == 2  # the warning in the span, "outside"
    assert points == []
    assert receiver.drain() == ([], [], [])
    assert (receiver.spans(), receiver.log_records()) == ([], [])
    assert receiver.requests[("grpc", "traces")] >= 1  # request counts are kept
