"""An OTLP/gRPC receiver on 127.0.0.1 that counts spans and keeps nothing.

protobuf parses the requests in C, so the receiving side, which a real collector runs on
other cores, takes little of the benchmark machine's two. Prints its endpoint; at the end
of its input, the number of spans received.

    python benchmarks/counting_receiver.py
"""

from __future__ import annotations

import sys
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request: Any, context: Any) -> Any:
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(self, request: Any, context: Any) -> Any:
        return metrics_service_pb2.ExportMetricsServiceResponse()


class Logs(logs_service_pb2_grpc.LogsServiceServicer):
    def Export(self, request: Any, context: Any) -> Any:
        return logs_service_pb2.ExportLogsServiceResponse()


def main() -> None:
    # One thread: the count needs no lock, and exporters send one request at a time.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    traces = Traces()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"http://127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    server.stop(0).wait()
    print(traces.spans, flush=True)


if __name__ == "__main__":
    main()
