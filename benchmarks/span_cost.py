"""CPU per span of each step a span takes through the SDK as dask-otel configures it.

One ``task``-like span (8 attributes, a state event, two dependency links) is built and
ended through the SDK (``start_span`` and ``end``, as dask-otel's emitter does), queued as
dask-otel's span processor queues it (``compact``), checked and rebuilt for the exporter
(``sanitize.requests``, ``rebuild``), and encoded as the OTLP exporters encode it (in
batches of 512). Each step is timed in this thread, alone: inside a cluster the same
steps share the GIL and the cores with Dask, and take longer.

    python benchmarks/span_cost.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from dask_otel.export import otlp_encoding, processors, queued_spans, sanitize, span_writer

PARENT = trace.SpanContext(0x1234, 0x5678, False, trace.TraceFlags(trace.TraceFlags.SAMPLED))
LINKS = [
    trace.Link(
        trace.SpanContext(0x1234, 0x90 + i, False, trace.TraceFlags(trace.TraceFlags.SAMPLED)),
        {"dask.link": "dependency"},
    )
    for i in range(2)
]
ATTRIBUTES = {
    "dask.cluster.id": "Scheduler-5b1e7c3f-0a7d-4d4e-9a3c-3c0b7e5f1d2a",
    "dask.task.key": "('add-6f1c0e2b9d7a4c3e8b5f', 12)",
    "dask.task.prefix": "add",
    "dask.task.group": "add-6f1c0e2b9d7a4c3e8b5f",
    "dask.task.state": "memory",
    "dask.task.attempts": 1,
    "dask.worker.address": "tcp://10.0.0.12:40123",
    "dask.task.nbytes": 28,
}
EVENT = {
    "dask.stimulus.id": "task-finished-1732412345.123",
    "dask.worker.address": "tcp://10.0.0.12:40123",
}


class Discarding(SpanExporter):
    def export(self, spans: object) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Keeping(SpanProcessor):
    """Keeps the last span that ended, and does nothing else."""

    span: ReadableSpan | None = None

    def on_end(self, span: ReadableSpan) -> None:
        self.span = span


def per_call(step: Callable[[], object], calls: int, per: int = 1) -> float:
    """Microseconds of this thread's CPU per unit (a call handles ``per`` units)."""
    started = time.thread_time()
    for _ in range(calls):
        step()
    return (time.thread_time() - started) / calls / per * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20_000)
    args = parser.parse_args()
    kept = Keeping()
    provider = TracerProvider()
    provider.add_span_processor(kept)
    tracer = provider.get_tracer("dask_otel")
    parent = trace.set_span_in_context(trace.NonRecordingSpan(PARENT))

    def build() -> None:
        span = tracer.start_span("task add", context=parent, attributes=ATTRIBUTES, links=LINKS)
        span.add_event("processing", EVENT)
        span.end()

    build()
    span = kept.span
    shared = queued_spans.SharedObjects()
    values = queued_spans.compact(span, shared)
    batch = [span] * 512

    # Lever (c): the same span written straight as the tuple dask-otel's processor queues.
    queued = processors.span_processor(Discarding())
    direct = TracerProvider()
    direct.add_span_processor(queued)
    writer = span_writer.span_writer(direct.get_tracer("dask_otel"))

    def write(attributes: dict = ATTRIBUTES, event: dict = EVENT) -> None:
        kind = trace.SpanKind.INTERNAL
        written = writer.start(0x42, "task add", PARENT, kind, 1, attributes, LINKS)
        written.add_event("processing", event)
        written.end(2)

    # Lever (b): the worker's identity on the resource, not on the span.
    local = {k: v for k, v in ATTRIBUTES.items() if k != "dask.worker.address"}
    local_event = {k: v for k, v in EVENT.items() if k != "dask.worker.address"}

    # Lever (d): the OTLP request encoded from the queued tuples (each span of the batch a
    # task of its own: its key differs, what repeats is cached).
    tuples = [
        (*values[:10], {**values[10], "dask.task.key": f"k{i}"}, *values[11:]) for i in range(512)
    ]
    encoder = otlp_encoding.Encoder(shared.__getitem__, shared.__getitem__)
    spans = sanitize.Spans(shared.is_own_scope)
    print(f"CPU us per span (median of 5 runs of {args.spans:,} spans each):")
    steps = {
        "start_span, add_event, end (the SDK's span)": lambda: per_call(build, args.spans),
        "compact (queued by dask-otel's processor)": lambda: per_call(
            lambda: queued_spans.compact(span, shared), args.spans
        ),
        "rebuild (for the exporter)": lambda: per_call(
            lambda: queued_spans.rebuild(values, shared), args.spans
        ),
        "check before export (sanitize, batches of 512)": lambda: per_call(
            lambda: list(sanitize.requests(tuples, spans)), max(1, args.spans // 512), 512
        ),
        "OTLP encoding (batches of 512)": lambda: per_call(
            lambda: encode_spans(batch).SerializeToString(), max(1, args.spans // 512), 512
        ),
        "(c) written as a tuple, queued (SpanWriter)": lambda: per_call(write, args.spans),
        "(b) the same, worker address on the resource": lambda: per_call(
            lambda: write(local, local_event), args.spans
        ),
        "(d) OTLP encoding from the tuples (512)": lambda: per_call(
            lambda: encoder.encode(tuples), max(1, args.spans // 512), 512
        ),
        "(d) ... and parsed into the gRPC request": lambda: per_call(
            lambda: ExportTraceServiceRequest.FromString(encoder.encode(tuples)),
            max(1, args.spans // 512),
            512,
        ),
    }
    for name, measure in steps.items():
        runs = sorted(measure() for _ in range(5))
        print(f"  {name:<46} {runs[2]:6.1f}  (min {runs[0]:.1f}, max {runs[-1]:.1f})")


if __name__ == "__main__":
    main()
