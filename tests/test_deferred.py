"""DeferredSpan: current and recording on the event loop, replayed on the real span later;
EndedSpans: spans of finished work, built by an emitter from times and attributes."""

from __future__ import annotations

import gc
import weakref
from time import time_ns

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from dask_otel.export.span_writer import span_writer
from dask_otel.spans import ids
from dask_otel.spans.emitter import SpanEmitter
from dask_otel.spans.records import MAX_CALLS, DeferredSpan, EndedSpans

PARENT = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(1))


def real_span_for(deferred: DeferredSpan):
    """The span the worker's emitter builds: same id, then the replay, then the end."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    setter = ids.SpanIdSetter(provider.get_tracer("test"))
    span = setter.start_span(
        deferred.get_span_context().span_id,
        "execute",
        context=trace.set_span_in_context(trace.NonRecordingSpan(PARENT)),
    )
    deferred.replay(span)
    span.end()
    (finished,) = exporter.get_finished_spans()
    return finished


def test_it_is_a_recording_child_of_the_parents_trace():
    deferred = DeferredSpan(PARENT)
    context = deferred.get_span_context()
    assert deferred.is_recording()
    assert context.trace_id == PARENT.trace_id
    assert context.span_id not in (0, PARENT.span_id)
    assert context.trace_flags.sampled and not context.is_remote
    assert DeferredSpan(PARENT).get_span_context().span_id != context.span_id
    assert deferred.get_span_context() == context  # drawn once


def test_everything_done_to_it_is_replayed_in_order_with_its_times():
    deferred = DeferredSpan(PARENT)
    before = time_ns()
    deferred.set_attribute("rows", 1)
    deferred.set_attributes({"rows": 2, "table": "t"})
    deferred.add_event("checkpoint", {"step": 1})
    deferred.add_event("explicit", timestamp=42)
    deferred.add_link(trace.SpanContext(7, 8, False), {"why": "input"})
    deferred.update_name("execute renamed")
    try:
        raise ValueError("bad row")
    except ValueError as e:
        deferred.record_exception(e, {"row": 3})
    deferred.set_status(Status(StatusCode.ERROR, "bad row"))
    deferred.end()  # ignored: the owner ends the real span
    after = time_ns()

    span = real_span_for(deferred)
    assert span.context.span_id == deferred.get_span_context().span_id
    assert span.parent.span_id == PARENT.span_id
    assert span.name == "execute renamed"
    assert dict(span.attributes) == {"rows": 2, "table": "t"}
    checkpoint, explicit, exception = span.events
    assert checkpoint.name == "checkpoint" and checkpoint.attributes["step"] == 1
    assert before <= checkpoint.timestamp <= after  # when it was made, not when replayed
    assert explicit.timestamp == 42
    assert exception.name == "exception"
    assert exception.attributes["exception.message"] == "bad row"
    assert exception.attributes["row"] == 3
    assert "raise ValueError" in exception.attributes["exception.stacktrace"]
    assert before <= exception.timestamp <= after
    (link,) = span.links
    assert (link.context.span_id, link.attributes["why"]) == (8, "input")
    assert span.status.status_code is StatusCode.ERROR


def test_it_keeps_no_exception_until_it_is_replayed():
    """``record_exception`` in a task: the exception's frames hold the task's data, which
    must not live until the emitter builds the span. The event is the SDK's all the same."""

    class Data:
        pass

    def fail(data: Data) -> None:
        raise ValueError("bad row")

    deferred = DeferredSpan(PARENT)
    data = Data()
    alive = weakref.ref(data)
    try:
        fail(data)
    except ValueError as e:
        deferred.record_exception(e, timestamp=5)
        sdk = TracerProvider().get_tracer("test").start_span("sdk")
        sdk.record_exception(e, timestamp=5)
        sdk.end()
    del data
    gc.collect()
    assert alive() is None
    (event,) = real_span_for(deferred).events
    assert event.name == "exception" and event.timestamp == 5
    assert dict(event.attributes) == dict(sdk.events[0].attributes)


def test_calls_are_bounded():
    deferred = DeferredSpan(PARENT)
    for i in range(MAX_CALLS + 100):
        deferred.add_event(f"e{i}")
    span = real_span_for(deferred)
    # The first MAX_CALLS were kept; of those, the SDK keeps its own limit (the latest).
    assert len(span.events) == min(MAX_CALLS, 128)
    assert span.events[-1].name == f"e{MAX_CALLS - 1}"


#: The task ``x-1`` of the trace ``PARENT`` carries.
X1 = ids.TaskRef(ids.Carrier(PARENT), "x-1")


def ended_spans() -> tuple[EndedSpans, SpanEmitter, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    emitter = SpanEmitter("test-ended-spans")
    tracer = provider.get_tracer("test")
    spans = EndedSpans(tracer, emitter, limit=64, writer=span_writer(tracer))
    return spans, emitter, exporter


def test_ended_spans_are_built_in_the_emitter_under_the_task_span():
    spans, emitter, exporter = ended_spans()
    spans.submit("get_data", X1, trace.SpanKind.SERVER, (100, 200), {"n": 1}, None)
    failure = OSError("disk full")
    spans.submit("spill x", X1, trace.SpanKind.INTERNAL, (300, 400), {}, failure)
    assert not exporter.get_finished_spans()  # nothing built by the caller
    assert emitter.flush(10)
    sent, spilled = exporter.get_finished_spans()
    assert (sent.name, sent.kind, sent.start_time, sent.end_time) == (
        "get_data",
        trace.SpanKind.SERVER,
        100,
        200,
    )
    assert sent.parent.span_id == ids.task_span_id(PARENT, "x-1")
    assert sent.context.trace_id == PARENT.trace_id and dict(sent.attributes) == {"n": 1}
    assert sent.status.status_code is StatusCode.UNSET
    assert spilled.status.status_code is StatusCode.ERROR
    (event,) = spilled.events
    assert (event.name, event.timestamp) == ("exception", 400)
    assert event.attributes["exception.type"] == "OSError"


def test_an_ended_span_takes_the_id_and_calls_of_the_span_current_meanwhile():
    spans, emitter, exporter = ended_spans()
    current = DeferredSpan(PARENT)  # what a transfer's rpc spans nested under
    current.set_status(Status(StatusCode.ERROR, "network_failure"))
    served = [ids.TaskRef(ids.Carrier(PARENT), "y-2")]
    spans.submit("transfer", X1, trace.SpanKind.CLIENT, (1, 2), {}, None, served, current)
    assert emitter.flush(10)
    (transfer,) = exporter.get_finished_spans()
    assert transfer.context.span_id == current.get_span_context().span_id
    assert transfer.status.status_code is StatusCode.ERROR
    (link,) = transfer.links
    assert link.context.span_id == ids.task_span_id(PARENT, "y-2")
    assert dict(link.attributes) == {"dask.link": "served"}


def test_an_ended_span_under_a_span_context_or_none():
    spans, emitter, exporter = ended_spans()
    spans.submit("rpc who_has", PARENT, trace.SpanKind.CLIENT, (1, 2), {}, None)
    spans.submit("rpc who_has", trace.INVALID_SPAN_CONTEXT, trace.SpanKind.SERVER, (1, 2), {}, None)
    assert emitter.flush(10)
    child, root = exporter.get_finished_spans()
    assert (child.context.trace_id, child.parent.span_id) == (PARENT.trace_id, PARENT.span_id)
    assert root.parent is None and root.context.trace_id != PARENT.trace_id


# -- spans written straight as tuples (an SDK tracer) versus through start_span ----------


class AnotherTracer(trace.Tracer):
    """Another SDK's tracer (here one that hands everything to the SDK's, preset span
    ids included): dask-otel starts its spans through the API."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    @property
    def id_generator(self):
        return self._tracer.id_generator

    @id_generator.setter
    def id_generator(self, generator) -> None:
        self._tracer.id_generator = generator

    def start_span(self, *args, **kwargs):
        return self._tracer.start_span(*args, **kwargs)

    def start_as_current_span(self, *args, **kwargs):
        return self._tracer.start_as_current_span(*args, **kwargs)


def written_and_started(limits=None, processor=None):
    """The same span built by EndedSpans with its SpanWriter and through ``start_span``
    (the path of any other tracer), exported by ``processor`` (default: the SDK's
    SimpleSpanProcessor) into memory: (written, started)."""
    from opentelemetry.sdk.trace import SpanLimits

    from dask_otel.spans import errors

    results = []
    for direct in (True, False):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(span_limits=limits or SpanLimits())
        provider.add_span_processor((processor or SimpleSpanProcessor)(exporter))
        emitter = SpanEmitter("test-written")
        tracer = provider.get_tracer("test", "1.0")
        tracer = tracer if direct else AnotherTracer(tracer)
        spans = EndedSpans(tracer, emitter, limit=64, writer=span_writer(tracer))
        assert spans.direct is direct
        current = DeferredSpan(PARENT)
        current.set_attribute("user.rows", 3)
        current.set_attribute("n", 2)  # set again: moves to the end, as in the SDK
        current.set_attributes({"user.x": 1, "user.rows": 4})  # plain, one set again
        current.set_attribute(["not", "a", "key"], 1)  # dropped and counted, as in the SDK
        current.set_attributes({"user.list": [1, 2], "user.bad": object()})
        current.add_event("user.checkpoint", {"step": 1}, timestamp=150)
        current.set_status(Status(StatusCode.OK))
        current.set_status(StatusCode.ERROR, "ignored after OK")
        current.update_name("renamed")
        current.add_link(trace.SpanContext(0x1234, 0x99, False), {"why": "user"})
        current.record_exception(ValueError("inside"), timestamp=160)
        served = [ids.TaskRef(ids.Carrier(PARENT), "y-2")]
        failure = errors.failure(KeyError("k"))
        spans.build(
            "transfer", X1, trace.SpanKind.CLIENT, (100, 200), {"n": 1}, failure, served, current,
            {"thread.id": 7}, 0x77,
        )  # fmt: skip
        assert emitter.flush(10)
        provider.force_flush()
        (span,) = exporter.get_finished_spans()
        results.append(span)
        provider.shutdown()
    return results


def fields(span) -> dict:
    return {
        "name": span.name,
        "context": (span.context.trace_id, span.context.span_id, span.context.trace_flags),
        "parent": (span.parent.span_id, span.parent.is_remote),
        "kind": span.kind,
        "times": (span.start_time, span.end_time),
        "attributes": list(span.attributes.items()),  # in order
        "events": [(e.name, e.timestamp, dict(e.attributes)) for e in span.events],
        "links": [(link.context.span_id, dict(link.attributes)) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "dropped": (span.dropped_attributes, span.dropped_events, span.dropped_links),
        "resource": span.resource,
        "scope": span.instrumentation_scope,
    }


def test_a_written_span_is_the_span_start_span_makes():
    written, started = written_and_started()
    assert fields(written) == fields(started)
    assert written.status.status_code is StatusCode.OK  # OK is final, as in the SDK


def test_a_written_span_keeps_the_sdks_limits():
    from opentelemetry.sdk.trace import SpanLimits

    limits = SpanLimits(max_span_attributes=2, max_events=1, max_links=1, max_attribute_length=3)
    written, started = written_and_started(limits)
    assert fields(written) == fields(started)
    assert written.dropped_attributes and written.dropped_events and written.dropped_links


def test_a_written_span_keeps_the_sdks_count_limit_without_a_length_limit():
    """Plain values and no length limit: kept as they are until the count limit bites."""
    from opentelemetry.sdk.trace import SpanLimits

    written, started = written_and_started(SpanLimits(max_span_attributes=1))
    assert fields(written) == fields(started)
    assert written.dropped_attributes == started.dropped_attributes > 0


def test_with_dask_otels_processor_alone_the_tuple_is_queued_directly():
    from dask_otel.export import processors

    written, started = written_and_started(processor=processors.span_processor)
    assert fields(written) == fields(started)
