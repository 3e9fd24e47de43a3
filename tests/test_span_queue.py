"""The span processor dask-otel configures queues spans as plain tuples.

An ended SDK span is a dozen objects the garbage collector tracks; queued until a batch
is ready they reach its oldest generation and trigger full collections of Dask's heap.
dask-otel's processor keeps one tuple per span instead and rebuilds the ReadableSpan
for the exporter: what the exporter receives must be the span, field for field.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from dask_otel.export import processors


class Keeping(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans):
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def make_spans(tracer: trace.Tracer) -> None:
    """Spans using every field the SDK exports, and over its limits."""
    remote = SpanContext(
        0xABC,
        0xDEF,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("k", "v")]),
    )
    with tracer.start_as_current_span(
        "root",
        kind=SpanKind.SERVER,
        attributes={"s": "x", "i": 1, "f": 0.5, "b": True},
        start_time=500,
        end_on_exit=False,
    ) as root:
        span = tracer.start_span(
            "child",
            kind=SpanKind.CLIENT,
            links=[Link(remote, {"dask.link": "dependency"})],
            start_time=1_000,
        )
        span.set_attribute("list", ["a", "b"])
        for n in range(130):  # over the SDK's 128 attributes and 128 events
            span.set_attribute(f"a{n}", n)
            span.add_event(f"e{n}", {"n": n}, timestamp=2_000 + n)
        span.record_exception(ValueError("boom"), timestamp=8_000)
        span.set_status(Status(StatusCode.ERROR, "it failed"))
        span.end(9_000)
        root.end(10_000)
    remote_child = tracer.start_span(
        "remote child",
        context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
        start_time=11_000,
    )
    remote_child.end(12_000)


class CountingIds(IdGenerator):
    """The same ids in every run, so two providers make identical spans."""

    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return self.n


def exported(processor) -> list:
    exporter = Keeping()
    provider = TracerProvider(id_generator=CountingIds())
    provider.add_span_processor(processor(exporter))
    make_spans(provider.get_tracer("test", "1.0"))
    provider.force_flush()
    provider.shutdown()
    return exporter.spans


def test_exporter_receives_the_spans_the_sdk_made():
    plain = exported(SimpleSpanProcessor)
    queued = exported(processors.span_processor)
    assert [s.name for s in queued] == [s.name for s in plain] == ["child", "root", "remote child"]
    child = queued[0]
    assert child.dropped_attributes == plain[0].dropped_attributes > 0
    assert child.dropped_events == plain[0].dropped_events > 0
    assert child.parent.span_id == plain[0].parent.span_id
    assert queued[2].parent.is_remote and queued[2].context.trace_state == TraceState([("k", "v")])
    (link,) = child.links
    assert link.context.trace_state == TraceState([("k", "v")]) and link.context.is_remote
    # What OTLP sends is identical, ids, times, limits and all.
    assert encode_spans(queued) == encode_spans(plain)


def test_queued_spans_hold_no_objects_the_collector_tracks():
    exporter = Keeping()
    processor = processors.span_processor(exporter)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    attributes = {"dask.task.key": "x-1", "dask.task.attempts": 1, "dask.task.workers": ["a"]}
    for _ in range(3):
        tracer.start_span("task x", attributes=attributes).end()
    with processor.export_queue.held_still() as queue:
        gc.collect()
        # One tuple per span: its attribute dict and everything else are untracked.
        assert len(queue) == 3
        for values in queue:
            assert not [v for v in values if gc.is_tracked(v)]
    provider.shutdown()
    assert len(exporter.spans) == 3


class ReadOnlyAttributes(Mapping):
    """A Mapping with no ``copy``, unlike the SDK's own attributes."""

    def __init__(self, **values: object) -> None:
        self._values = values

    def __getitem__(self, key: str) -> object:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def test_a_span_the_sdk_did_not_make_is_queued_too():
    exporter = Keeping()
    processor = processors.span_processor(exporter)
    sampled = SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1))
    processor.on_end(ReadableSpan("by hand", context=sampled, attributes=ReadOnlyAttributes(k="v")))
    processor.force_flush()
    (span,) = exporter.spans
    assert (span.name, dict(span.attributes)) == ("by hand", {"k": "v"})
    processor.shutdown()


def test_unsampled_spans_are_not_queued():
    exporter = Keeping()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(processors.span_processor(exporter))
    provider.get_tracer("test").start_span("dropped").end()
    provider.shutdown()
    assert exporter.spans == []


def test_batch_options_pass_through():
    processor = processors.span_processor(Keeping(), max_queue_size=7, max_export_batch_size=3)
    try:
        assert processor.export_queue.limits.max_items == 7
        assert processor.export_queue.limits.batch == 3
    finally:
        processor.shutdown()
