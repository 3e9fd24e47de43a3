"""In-process OTLP receiver (gRPC + HTTP/protobuf) for tests.

Real OpenTelemetry SDK exporters can be pointed at it; everything received is decoded into
plain Python dicts that tests can assert on::

    with OTLPReceiver() as rx:
        exporter = OTLPSpanExporter(endpoint=rx.grpc_endpoint, insecure=True)
        ...
        spans = rx.wait_for(lambda r: r.spans(name="work"))
"""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Literal, TypedDict, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

__all__ = [
    "UNANSWERED",
    "HungCollector",
    "LogRecordData",
    "MetricPointData",
    "OTLPReceiver",
    "SpanData",
    "StalledCollector",
    "any_value_to_python",
    "attributes_to_dict",
    "closed_port",
    "exporting_env",
    "unanswered",
]

Signal = Literal["traces", "metrics", "logs"]
Transport = Literal["grpc", "http"]
T = TypeVar("T")

_PROTOBUF = "application/x-protobuf"


class SpanData(TypedDict):
    """One received span."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    links: list[dict[str, Any]]
    status_code: int
    status_message: str
    resource: dict[str, Any]
    scope: str


class LogRecordData(TypedDict):
    """One received log record."""

    body: Any
    severity_number: int
    severity_text: str
    trace_id: str | None
    span_id: str | None
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    time_ns: int
    event_name: str


class MetricPointData(TypedDict):
    """One received metric data point (flattened with its metric's metadata)."""

    name: str
    description: str
    unit: str
    type: str
    value: Any
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    time_ns: int
    start_time_ns: int
    is_monotonic: bool | None
    aggregation_temporality: int | None


# --------------------------------------------------------------------------- decoding


def any_value_to_python(value: AnyValue) -> Any:
    """Decode an OTLP ``AnyValue`` (recursively) into plain Python; unset -> ``None``."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value_to_python(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_to_dict(value.kvlist_value.values)
    return getattr(value, kind)  # string/bool/int/double/bytes


def attributes_to_dict(attributes: Iterable[KeyValue]) -> dict[str, Any]:
    """Decode a repeated ``KeyValue`` field into a dict."""
    return {kv.key: any_value_to_python(kv.value) for kv in attributes}


def _hex_id(raw: bytes) -> str | None:
    """Hex-encode a trace/span id; empty or all-zero ids become ``None``."""
    return raw.hex() if raw and any(raw) else None


def _context(resource: Resource, scope: InstrumentationScope) -> dict[str, Any]:
    return {"resource": attributes_to_dict(resource.attributes), "scope": scope.name}


def _decode_spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanData]:
    out: list[SpanData] = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            ctx = _context(rs.resource, ss.scope)
            for s in ss.spans:
                out.append(
                    SpanData(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=_hex_id(s.parent_span_id),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=attributes_to_dict(s.attributes),
                        events=[
                            {
                                "name": e.name,
                                "time_ns": e.time_unix_nano,
                                "attributes": attributes_to_dict(e.attributes),
                            }
                            for e in s.events
                        ],
                        links=[
                            {
                                "trace_id": link.trace_id.hex(),
                                "span_id": link.span_id.hex(),
                                "attributes": attributes_to_dict(link.attributes),
                            }
                            for link in s.links
                        ],
                        status_code=s.status.code,
                        status_message=s.status.message,
                        **ctx,
                    )
                )
    return out


def _decode_logs(request: logs_service_pb2.ExportLogsServiceRequest) -> list[LogRecordData]:
    out: list[LogRecordData] = []
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            ctx = _context(rl.resource, sl.scope)
            for r in sl.log_records:
                out.append(
                    LogRecordData(
                        body=any_value_to_python(r.body),
                        severity_number=r.severity_number,
                        severity_text=r.severity_text,
                        trace_id=_hex_id(r.trace_id),
                        span_id=_hex_id(r.span_id),
                        attributes=attributes_to_dict(r.attributes),
                        time_ns=r.time_unix_nano,
                        event_name=r.event_name,
                        **ctx,
                    )
                )
    return out


def _point_value(kind: str, point: Any) -> Any:
    """The ``value`` entry of a data point, by metric type."""
    if kind in ("sum", "gauge"):
        which = point.WhichOneof("value")
        return getattr(point, which) if which else None
    value: dict[str, Any] = {
        "count": point.count,
        "sum": point.sum if kind == "summary" or point.HasField("sum") else None,
    }
    if kind == "histogram":
        value["bucket_counts"] = list(point.bucket_counts)
        value["explicit_bounds"] = list(point.explicit_bounds)
    elif kind == "exponential_histogram":
        value["scale"] = point.scale
        value["zero_count"] = point.zero_count
        value["positive"] = {
            "offset": point.positive.offset,
            "bucket_counts": list(point.positive.bucket_counts),
        }
        value["negative"] = {
            "offset": point.negative.offset,
            "bucket_counts": list(point.negative.bucket_counts),
        }
    else:  # summary
        value["quantile_values"] = {q.quantile: q.value for q in point.quantile_values}
    if kind != "summary":
        value["min"] = point.min if point.HasField("min") else None
        value["max"] = point.max if point.HasField("max") else None
    return value


def _metric_points(metric: Metric, ctx: dict[str, Any]) -> list[MetricPointData]:
    kind = metric.WhichOneof("data")
    if kind is None:
        return []
    data = getattr(metric, kind)
    return [
        MetricPointData(
            name=metric.name,
            description=metric.description,
            unit=metric.unit,
            type=kind,
            value=_point_value(kind, p),
            attributes=attributes_to_dict(p.attributes),
            time_ns=p.time_unix_nano,
            start_time_ns=p.start_time_unix_nano,
            is_monotonic=data.is_monotonic if kind == "sum" else None,
            aggregation_temporality=(
                None if kind in ("gauge", "summary") else data.aggregation_temporality
            ),
            **ctx,
        )
        for p in data.data_points
    ]


def _decode_metrics(
    request: metrics_service_pb2.ExportMetricsServiceRequest,
) -> list[MetricPointData]:
    out: list[MetricPointData] = []
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            ctx = _context(rm.resource, sm.scope)
            for metric in sm.metrics:
                out.extend(_metric_points(metric, ctx))
    return out


_DECODERS: dict[Signal, Callable[[Any], list[Any]]] = {
    "traces": _decode_spans,
    "metrics": _decode_metrics,
    "logs": _decode_logs,
}

# Per signal: request type, response type.
_MESSAGES: dict[Signal, tuple[type[Message], type[Message]]] = {
    "traces": (
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "metrics": (
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
    "logs": (
        logs_service_pb2.ExportLogsServiceRequest,
        logs_service_pb2.ExportLogsServiceResponse,
    ),
}


# --------------------------------------------------------------------------- gRPC


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, rx: OTLPReceiver) -> None:
        self._rx = rx

    def Export(self, request: Message, context: grpc.ServicerContext) -> Message:
        return self._rx._ingest("grpc", "traces", request)


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, rx: OTLPReceiver) -> None:
        self._rx = rx

    def Export(self, request: Message, context: grpc.ServicerContext) -> Message:
        return self._rx._ingest("grpc", "metrics", request)


class _LogsServicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, rx: OTLPReceiver) -> None:
        self._rx = rx

    def Export(self, request: Message, context: grpc.ServicerContext) -> Message:
        return self._rx._ingest("grpc", "logs", request)


# --------------------------------------------------------------------------- HTTP


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, rx: OTLPReceiver, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _OTLPHandler)
        self.rx = rx


class _OTLPHandler(BaseHTTPRequestHandler):
    """OTLP/HTTP with binary protobuf bodies (``POST /v1/{traces,metrics,logs}``)."""

    protocol_version = "HTTP/1.1"
    timeout = 5  # close idle keep-alive connections
    server: _HTTPServer
    _PATHS: ClassVar[dict[str, Signal]] = {
        "/v1/traces": "traces",
        "/v1/metrics": "metrics",
        "/v1/logs": "logs",
    }

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        signal = self._PATHS.get(self.path.split("?", 1)[0])
        if signal is None:
            return self._reply(404, b"unknown OTLP path", "text/plain")
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip()
        if content_type != _PROTOBUF:
            return self._reply(415, b"only application/x-protobuf is supported", "text/plain")
        try:
            payload = _decompress(body, self.headers.get("Content-Encoding"))
            request = _MESSAGES[signal][0].FromString(payload)
        except (OSError, EOFError, zlib.error, DecodeError, ValueError) as exc:
            return self._reply(400, f"bad request: {exc}".encode(), "text/plain")
        response = self.server.rx._ingest("http", signal, request)
        self._reply(200, response.SerializeToString(), _PROTOBUF)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:
        """Keep test output quiet."""


def _decompress(body: bytes, encoding: str | None) -> bytes:
    """Undo ``Content-Encoding`` (identity, gzip or deflate)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:
            return zlib.decompress(body, -zlib.MAX_WBITS)  # raw deflate
    raise ValueError(f"unsupported Content-Encoding {encoding!r}")


# --------------------------------------------------------------------------- receiver


class OTLPReceiver:
    """OTLP receiver on 127.0.0.1: gRPC and HTTP/protobuf, each on a free port.

    ``grpc_port``/``http_port`` bind given ports instead, e.g. to bring a collector back
    where a stopped one was (see :meth:`restarted`).
    """

    def __init__(self, grpc_port: int = 0, http_port: int = 0) -> None:
        self._lock = threading.Lock()
        self._spans: list[SpanData] = []
        self._logs: list[LogRecordData] = []
        self._metrics: list[MetricPointData] = []
        self._store: dict[Signal, list[Any]] = {
            "traces": self._spans,
            "metrics": self._metrics,
            "logs": self._logs,
        }
        self._requests: Counter[tuple[Transport, Signal]] = Counter()
        self._grpc_server: grpc.Server | None = None
        self._http_server: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc_port = 0
        self._http_port = 0
        self._ports = (grpc_port, http_port)
        self._stopped = False

    # lifecycle -------------------------------------------------------------

    def start(self) -> OTLPReceiver:
        """Start both servers (once); returns ``self``."""
        if self._grpc_server is not None or self._stopped:
            raise RuntimeError("OTLPReceiver can only be started once")
        executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-rx")
        server = grpc.server(executor)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsServicer(self), server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsServicer(self), server)
        self._grpc_port = server.add_insecure_port(f"127.0.0.1:{self._ports[0]}")
        if not self._grpc_port:
            raise RuntimeError("could not bind the OTLP gRPC receiver")
        server.start()
        self._grpc_server = server

        self._http_server = _HTTPServer(self, self._ports[1])
        self._http_port = self._http_server.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http_server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-rx-http",
            daemon=True,
        )
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop both servers immediately (no grace period). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=0).wait(5)
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
        if self._http_thread is not None:
            self._http_thread.join(5)

    def restarted(self) -> OTLPReceiver:
        """A new receiver, started on this (stopped) receiver's ports: the collector is back."""
        return OTLPReceiver(self._grpc_port, self._http_port).start()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the OTLP/gRPC server."""
        return self._endpoint(self._grpc_port)

    @property
    def http_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the OTLP/HTTP server (append ``/v1/traces`` etc.)."""
        return self._endpoint(self._http_port)

    @staticmethod
    def _endpoint(port: int) -> str:
        if not port:
            raise RuntimeError("OTLPReceiver is not started")
        return f"http://127.0.0.1:{port}"

    # ingestion -------------------------------------------------------------

    def _ingest(self, transport: Transport, signal: Signal, request: Any) -> Message:
        """Decode and store one export request; return the (empty, i.e. success) response."""
        items = _DECODERS[signal](request)
        with self._lock:
            self._requests[(transport, signal)] += 1
            self._store[signal].extend(items)
        return _MESSAGES[signal][1]()

    # queries ---------------------------------------------------------------

    def spans(self, name: str | None = None) -> list[SpanData]:
        """Received spans in arrival order, optionally only those called ``name``."""
        with self._lock:
            return [s for s in self._spans if name is None or s["name"] == name]

    def log_records(self) -> list[LogRecordData]:
        """Received log records in arrival order."""
        with self._lock:
            return list(self._logs)

    def metrics(self, name: str | None = None) -> list[MetricPointData]:
        """Received metric data points in arrival order, optionally only metric ``name``."""
        with self._lock:
            return [m for m in self._metrics if name is None or m["name"] == name]

    @property
    def requests(self) -> dict[tuple[Transport, Signal], int]:
        """Snapshot of export request counts keyed by ``(transport, signal)``."""
        with self._lock:
            return dict(self._requests)

    def drain(self) -> tuple[list[SpanData], list[LogRecordData], list[MetricPointData]]:
        """Spans, log records and metric points received so far, forgotten in the same step.

        A long run (scripts/peer_suite.py) counts what arrived in pieces, so the receiver
        does not hold hours of telemetry; request counts are kept.
        """
        with self._lock:
            taken = (self._spans[:], self._logs[:], self._metrics[:])
            for items in self._store.values():
                items.clear()
        return taken

    def clear(self) -> None:
        """Forget everything received so far (including request counts)."""
        with self._lock:
            self._spans.clear()
            self._logs.clear()
            self._metrics.clear()
            self._requests.clear()

    def summary(self) -> str:
        """Human-readable overview of what was received (used in failure messages)."""
        with self._lock:
            span_names = sorted({s["name"] for s in self._spans})
            metric_names = sorted({m["name"] for m in self._metrics})
            return (
                f"received {len(self._spans)} spans, {len(self._logs)} log records, "
                f"{len(self._metrics)} metric points; requests={dict(self._requests)}; "
                f"span names={span_names}; metric names={metric_names}"
            )

    def wait_for(
        self, predicate: Callable[[OTLPReceiver], T], timeout: float = 30.0, poll: float = 0.1
    ) -> T:
        """Poll ``predicate(self)`` until it returns something truthy and return that.

        Exceptions raised by the predicate (e.g. ``IndexError`` on a still-empty list) count
        as "not yet". On timeout an ``AssertionError`` summarising the received data is raised.
        """
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            try:
                result = predicate(self)
            except Exception as exc:
                last_error = exc
            else:
                last_error = None
                if result:
                    return result
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
        message = f"condition not met within {timeout}s; {self.summary()}"
        if last_error is not None:
            message += f"; last predicate error: {last_error!r}"
        raise AssertionError(message) from last_error


# --------------------------------------------------------------------------- faults


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: a collector that is not there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StalledCollector:
    """A hung collector: accepts TCP connections on 127.0.0.1 and never answers.

    Exporters connect, send their request and wait for their own timeout. ``port`` binds
    a given port (the one a stopped :class:`OTLPReceiver` used, say).
    """

    def __init__(self, port: int = 0) -> None:
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self._socket.listen(64)
        self._socket.settimeout(0.1)
        self.port: int = self._socket.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="stalled-collector", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Connections accepted so far (and held, unanswered)."""
        return len(self._held)

    def _hold(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._socket.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        """Drop every held connection and free the port. Idempotent."""
        self._stopped.set()
        self._thread.join(5)
        for conn in self._held:
            conn.close()
        self._socket.close()

    def __enter__(self) -> StalledCollector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CountingReceiver(OTLPReceiver):
    """A receiver that counts and keeps nothing: spans by the first word of their name, log
    records, span requests and bytes. Benchmarks use it: decoding 200,000 spans into dicts
    would make the receiver, not the exporter, the bottleneck."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            #: Spans received, by the first word of their name (``task``, ``transfer``...).
            self.span_names: Counter[str] = Counter()
            self.log_record_count = 0
            self.span_requests = 0
            self.span_bytes = self.max_request = 0
            #: ``time.monotonic()`` of the first and last span request.
            self.first: float | None = None
            self.last: float | None = None

    def _ingest(self, transport: Transport, signal: Signal, request: Any) -> Message:
        names: Counter[str] = Counter()
        records = 0
        if signal == "traces":
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    names.update(span.name.split(" ", 1)[0] for span in ss.spans)
        elif signal == "logs":
            records = sum(
                len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs
            )
        size, now = request.ByteSize(), time.monotonic()
        with self._lock:
            self._requests[(transport, signal)] += 1
            self.span_names.update(names)
            self.log_record_count += records
            if names:
                self.span_requests += 1
                self.span_bytes += size
                self.max_request = max(self.max_request, size)
                self.first = self.first or now
                self.last = now
        return _MESSAGES[signal][1]()

    def state(self) -> dict[str, Any]:
        """The counts, as JSON-ready values."""
        with self._lock:
            first, last = self.first, self.last
            return {
                "spans": dict(self.span_names),
                "log_records": self.log_record_count,
                "requests": self.span_requests,
                "bytes": self.span_bytes,
                "max_request": self.max_request,
                "seconds": (last - first) if first is not None and last is not None else 0.0,
                "idle": (time.monotonic() - last) if last is not None else None,
            }


class HungCollector(OTLPReceiver):
    """A hung collector that speaks OTLP (gRPC and HTTP): it takes every export request
    and never answers, until it is stopped.

    Unlike :class:`StalledCollector`, the gRPC handshake succeeds: an exporter's request is
    on its way and only its own deadline ends the wait.
    """

    def __init__(self, grpc_port: int = 0, http_port: int = 0) -> None:
        super().__init__(grpc_port, http_port)
        self._release = threading.Event()
        #: Export requests taken so far (each left unanswered).
        self.calls = 0

    def _ingest(self, transport: Transport, signal: Signal, request: Any) -> Message:
        with self._lock:
            self.calls += 1
        self._release.wait()
        return _MESSAGES[signal][1]()

    def stop(self) -> None:
        self._release.set()  # lets the server's threads go, so that it can stop
        super().stop()


#: The collectors that never answer, by name: see :func:`unanswered`.
UNANSWERED = ("down", "hung TCP", "hung gRPC")


@contextmanager
def unanswered(kind: str) -> Iterator[str]:
    """The OTLP/gRPC endpoint of a collector that never answers: ``down`` (a closed port),
    ``hung TCP`` (a :class:`StalledCollector`) or ``hung gRPC`` (a :class:`HungCollector`)."""
    if kind == "down":
        yield f"http://127.0.0.1:{closed_port()}"
    elif kind == "hung TCP":
        with StalledCollector() as stalled:
            yield stalled.endpoint
    elif kind == "hung gRPC":
        with HungCollector() as hung:
            yield hung.grpc_endpoint
    else:
        raise ValueError(f"unknown collector fault {kind!r}; one of {UNANSWERED}")


def exporting_env(endpoint: str, protocol: str = "grpc", **variables: str) -> dict[str, str]:
    """The environment of a process that exports everything to ``endpoint`` (a receiver's,
    or one of :func:`unanswered`): this process's without its ``OTEL_*``, ``DASK_*`` and
    ``PYTHONPATH``, so that only ``variables`` (added last) configure it beyond that."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "DASK_")) and k != "PYTHONPATH"
    }
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc" if protocol == "grpc" else "http/protobuf",
        DASK_DISTRIBUTED__DIAGNOSTICS__NVML="False",
        PYTHONUNBUFFERED="1",
    )
    env.update(variables)
    return env


def serve_counting() -> None:
    """``python tests/otlp_receiver.py --count``: a :class:`CountingReceiver` in a process
    of its own. Prints its gRPC endpoint; answers each line of input (``state``, or
    ``reset`` first) with its counts as JSON, and once more at the end of its input."""
    import json

    with CountingReceiver() as rx:
        print(rx.grpc_endpoint, flush=True)
        for line in sys.stdin:
            if line.strip() == "reset":
                rx.reset()
            print(json.dumps(rx.state()), flush=True)
        print(json.dumps(rx.state()), flush=True)


def spawn_counting() -> tuple[str, subprocess.Popen]:
    """(gRPC endpoint, process) of :func:`serve_counting` in a process of its own, as the
    benchmarks and scripts run it (its CPU and GIL apart from what they measure)."""
    process = subprocess.Popen(
        [sys.executable, __file__, "--count"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return process.stdout.readline().strip(), process  # type: ignore[union-attr]


if __name__ == "__main__":
    if sys.argv[1:] != ["--count"]:
        sys.exit("usage: python tests/otlp_receiver.py --count")
    serve_counting()
