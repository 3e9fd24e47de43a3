"""dask_otel.spans.ids: key text, span ids derived from (trace, key), traceparent carriers."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from dask_otel import strings
from dask_otel.spans import ids

TRACE_A = 0x0AF7651916CD43DD8448EB211C80319C
TRACE_B = 0x4BF92F3577B34DA6A3CE929D0E0E4736


def carrier_of(trace_id: int, span_id: int = 0x00F067AA0BA902B7) -> SpanContext:
    """The context a task's annotation carries (the submitting span)."""
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))


CARRIER_A = carrier_of(TRACE_A)
CARRIER_B = carrier_of(TRACE_B)


# -- key_to_str / cap -----------------------------------------------------------------------


def test_key_to_str_leaves_str_keys_alone():
    assert strings.key_to_str("inc-1234") == "inc-1234"
    assert strings.key_to_str("") == ""


def test_key_to_str_tuple_keys():
    key = ("sum-aggregate-8f3e", 0, 1)
    text = strings.key_to_str(key)
    assert isinstance(text, str)
    assert text == "('sum-aggregate-8f3e', 0, 1)"
    # Identical across calls and for equal tuples built separately.
    assert strings.key_to_str(key) == text
    assert strings.key_to_str(("sum-aggregate-8f3e", 0, 1)) == text
    assert strings.key_to_str(("x", 1)) != strings.key_to_str(("x", 2))
    assert strings.key_to_str(("x", 1)) != strings.key_to_str("x")


def test_cap():
    assert strings.cap("abc", 3) == "abc"
    assert strings.cap("", 5) == ""
    capped = strings.cap("abcdef", 4)
    assert capped == "abc\u2026"
    assert len(capped) == 4
    long = "k" * 1000
    assert len(strings.cap(long, 256)) == 256
    assert strings.cap(long, 256).endswith("\u2026")


# -- task_span_id ---------------------------------------------------------------------------


def test_task_span_id_is_deterministic():
    assert ids.task_span_id(CARRIER_A, "inc-1") == ids.task_span_id(CARRIER_A, "inc-1")


def test_task_span_id_differs_by_submitting_span_in_one_trace():
    # The same key computed again by a later submission in the same trace: a new span.
    again = carrier_of(TRACE_A, span_id=0x1)
    assert ids.task_span_id(CARRIER_A, "inc-1") != ids.task_span_id(again, "inc-1")


def test_task_span_id_differs_by_key_and_by_trace():
    a1 = ids.task_span_id(CARRIER_A, "inc-1")
    assert a1 != ids.task_span_id(CARRIER_A, "inc-2")
    assert a1 != ids.task_span_id(CARRIER_B, "inc-1")
    tuple_key = strings.key_to_str(("x", 1))
    assert ids.task_span_id(CARRIER_A, tuple_key) != ids.task_span_id(CARRIER_A, "x")


@pytest.mark.parametrize("trace_id", [1, TRACE_A, TRACE_B, (1 << 128) - 1])
def test_task_span_id_is_a_valid_64_bit_span_id(trace_id):
    keys = [f"task-{i}" for i in range(2000)] + ["", "\u00e9\u4e2d", "\ud800"]
    span_ids = [ids.task_span_id(carrier_of(trace_id), key) for key in keys]
    for span_id in span_ids:
        assert isinstance(span_id, int)
        assert 0 < span_id < 2**64
    # 2000+ keys, no collisions, and the top bit is used (ids are not 63-bit or smaller).
    assert len(set(span_ids)) == len(span_ids)
    assert any(span_id >= 2**63 for span_id in span_ids)


def test_each_generation_of_a_task_has_its_own_span_id():
    """A task's attempts that end without a result move it to a new generation: each has
    an id of its own; generation 0 is the id of trace model v1."""
    by_generation = [ids.task_span_id(CARRIER_A, "inc-1", g) for g in range(50)]
    assert len(set(by_generation)) == 50
    assert by_generation[0] == ids.task_span_id(CARRIER_A, "inc-1")
    # No generation of one key names another key's span.
    others = {ids.task_span_id(CARRIER_A, f"inc-{i}") for i in range(2, 50)}
    assert not set(by_generation) & others


def test_attempt_span_id_from_the_annotation_alone():
    """What a Nanny (or any process) computes from the annotation the attempt ran with."""
    carrier = ids.Carrier(CARRIER_A, generation=3)
    assert ids.attempt_span_id(carrier.encode(), ("x", 1)) == (
        TRACE_A,
        ids.task_span_id(CARRIER_A, "('x', 1)", 3),
    )
    assert ids.attempt_span_id(None, "x") is None
    assert ids.attempt_span_id(object(), "x") is None


# -- the carrier: encode / parse ----------------------------------------------------------


@pytest.mark.parametrize(
    "carrier",
    [
        ids.Carrier(CARRIER_A),
        ids.Carrier(CARRIER_A, generation=7, thinned=True),
        ids.Carrier(CARRIER_B, partial=True),
        ids.Carrier(CARRIER_B, from_client=True),
        ids.Carrier(CARRIER_A, links=()),
        ids.Carrier(CARRIER_A, links=(carrier_of(TRACE_B, 5), carrier_of(TRACE_A, 9))),
    ],
)
def test_carrier_round_trip(carrier):
    back = ids.parse(carrier.encode())
    assert back is not None
    assert back.context.trace_id == carrier.context.trace_id
    assert back.context.span_id == carrier.context.span_id
    assert back.context.trace_flags == carrier.context.trace_flags
    assert back._replace(context=carrier.context, links=None) == carrier._replace(links=None)
    if carrier.links is None:
        assert back.links is None
    else:
        assert [(c.trace_id, c.span_id) for c in back.links] == [
            (c.trace_id, c.span_id) for c in carrier.links
        ]


def test_a_carrier_without_options_is_a_traceparent():
    assert ids.Carrier(CARRIER_A).encode() == ids.encode(CARRIER_A)


@pytest.mark.parametrize("suffix", [";g=x", ";g=", ";unknown", ";links=zz-1"])
def test_a_carrier_with_options_not_ours_is_not_a_carrier(suffix):
    assert ids.parse(ids.encode(CARRIER_A) + suffix) is None


def test_a_task_span_links_its_earlier_attempts():
    carrier = ids.Carrier(CARRIER_A, generation=2)
    assert carrier.span_id("k") == ids.task_span_id(CARRIER_A, "k", 2)
    links = ids.earlier_attempt_links(CARRIER_A, "k", carrier.generation)
    assert [link.context.span_id for link in links] == [
        ids.task_span_id(CARRIER_A, "k", 0),
        ids.task_span_id(CARRIER_A, "k", 1),
    ]
    assert all(link.context.trace_id == CARRIER_A.trace_id for link in links)
    assert all(link.attributes == {"dask.link": "earlier-attempt"} for link in links)
    assert ids.earlier_attempt_links(CARRIER_A, "k", 0) == []
    many = ids.earlier_attempt_links(CARRIER_A, "k", 100)
    assert len(many) == ids.MAX_EARLIER_ATTEMPT_LINKS
    assert many[-1].context.span_id == ids.task_span_id(CARRIER_A, "k", 99)


# -- encode / decode ------------------------------------------------------------------------


def test_encode_decode_round_trip():
    sc = SpanContext(
        trace_id=TRACE_A,
        span_id=0x00F067AA0BA902B7,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    text = ids.encode(sc)
    assert text == "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
    back = ids.decode(text)
    assert back is not None
    assert back.trace_id == sc.trace_id
    assert back.span_id == sc.span_id
    assert back.trace_flags == sc.trace_flags
    assert back.trace_flags.sampled
    assert back.is_remote


def test_encode_decode_unsampled():
    sc = SpanContext(trace_id=TRACE_B, span_id=7, is_remote=False, trace_flags=TraceFlags(0))
    back = ids.decode(ids.encode(sc))
    assert back is not None
    assert (back.trace_id, back.span_id) == (TRACE_B, 7)
    assert not back.trace_flags.sampled


@pytest.mark.parametrize(
    "value",
    [
        None,
        0,
        12345,
        1.5,
        b"00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01",
        ["00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"],
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"},
        "",
        "garbage",
        "not-a-traceparent-at-all",
        # Someone else's annotation value under the same name.
        "high-priority",
        # Malformed traceparents.
        "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7",
        "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-0",
        "00-0af7651916cd43dd8448eb211c8031-00f067aa0ba902b7-01",
        "00-zzf7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01",
        "ff-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    ],
)
def test_decode_returns_none_for_anything_else(value):
    assert ids.decode(value) is None


# -- task_context ---------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [TraceFlags.SAMPLED, TraceFlags.DEFAULT])
def test_task_context_parent_is_the_task_span(flags):
    carrier = SpanContext(
        trace_id=TRACE_A, span_id=0x1234, is_remote=True, trace_flags=TraceFlags(flags)
    )
    ctx = ids.task_context(ids.TaskRef(ids.Carrier(carrier), "inc-1"))
    parent = trace.get_current_span(ctx).get_span_context()
    assert parent.trace_id == TRACE_A
    assert parent.span_id == ids.task_span_id(carrier, "inc-1")
    assert parent.span_id != carrier.span_id
    assert parent.is_remote
    assert parent.trace_flags == carrier.trace_flags


def test_task_context_parents_real_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        carrier = SpanContext(
            trace_id=TRACE_B,
            span_id=0x42,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        tracer = provider.get_tracer("test")
        task = ids.TaskRef(ids.Carrier(carrier, generation=2), "k")
        tracer.start_span("child", context=ids.task_context(task)).end()
        (span,) = exporter.get_finished_spans()
        assert span.context.trace_id == TRACE_B
        assert span.parent.span_id == ids.task_span_id(carrier, "k", 2)
    finally:
        provider.shutdown()


# -- SpanIdSetter ---------------------------------------------------------------------------


@pytest.fixture
def sdk():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_span_id_setter_presets_one_span(sdk):
    provider, exporter = sdk
    tracer = provider.get_tracer("test-setter")
    setter = ids.SpanIdSetter(tracer)
    wanted = ids.task_span_id(CARRIER_A, "inc-1")

    setter.start_span(wanted, "preset").end()
    tracer.start_span("after").end()
    with tracer.start_as_current_span("random-parent"):
        setter.start_span(wanted + 1, "preset-child").end()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["preset"].context.span_id == wanted
    assert spans["preset-child"].context.span_id == wanted + 1
    # The parent of the preset child is the current span, not disturbed by the preset.
    assert spans["preset-child"].parent.span_id == spans["random-parent"].context.span_id
    # Spans started without a preset get random ids.
    assert spans["after"].context.span_id not in (wanted, wanted + 1)
    assert spans["random-parent"].context.span_id not in (wanted, wanted + 1)


def test_span_id_setter_leaves_other_spans_random(sdk):
    provider, exporter = sdk
    tracer = provider.get_tracer("test-random")
    setter = ids.SpanIdSetter(tracer)
    wanted = 0xDEADBEEF
    for _ in range(50):
        tracer.start_span("plain").end()
    setter.start_span(wanted, "preset").end()
    for _ in range(50):
        tracer.start_span("plain").end()
    plain = [s.context.span_id for s in exporter.get_finished_spans() if s.name == "plain"]
    assert len(plain) == 100
    assert wanted not in plain
    assert len(set(plain)) == 100


def test_span_id_setter_is_reusable_and_wraps_once(sdk):
    provider, exporter = sdk
    tracer = provider.get_tracer("test-reuse")
    first = ids.SpanIdSetter(tracer)
    generator = tracer.id_generator
    second = ids.SpanIdSetter(tracer)
    # A second setter on the same tracer reuses the wrapper instead of nesting another.
    assert tracer.id_generator is generator
    first.start_span(11, "one").end()
    second.start_span(22, "two").end()
    spans = {s.name: s.context.span_id for s in exporter.get_finished_spans()}
    assert spans == {"one": 11, "two": 22}


def test_span_id_setter_preset_does_not_leak_after_failure(sdk):
    provider, exporter = sdk
    tracer = provider.get_tracer("test-leak")
    setter = ids.SpanIdSetter(tracer)
    with pytest.raises(TypeError):
        setter.start_span(99, "bad", not_an_argument=True)
    tracer.start_span("next").end()
    (span,) = exporter.get_finished_spans()
    assert span.context.span_id != 99


def test_span_id_setter_on_noop_tracer():
    setter = ids.SpanIdSetter(trace.NoOpTracer())
    span = setter.start_span(5, "noop")
    assert not span.is_recording()
    span.end()
