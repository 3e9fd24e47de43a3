"""Deterministic span ids and the trace context carried in task annotations.

The scheduler knows each graph's trace context and stores it in every task's annotations
under :data:`ANNOTATION` (a W3C ``traceparent``). ``distributed`` already ships a task's
annotations to the worker inside ``compute-task``, so every process that touches a task
knows its trace id without an extra message. The span id of a task's ``task`` span is a
hash of (that trace context, key): the scheduler, the worker that runs it and any worker
that moves its data all name the same parent without waiting for each other.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: Name of the task annotation that carries the trace context.
ANNOTATION = "otel"
#: Appended to the (unsampled) carrier of a task whose spans the scheduler thinned out of
#: a sampled trace: its worker still reports it if it fails or is slow.
THINNED = ";thinned"

_propagator = TraceContextTextMapPropagator()
logger = logging.getLogger(__name__)


def key_to_str(key: Any) -> str:
    """The stable text form of a Dask key (tuple keys included), identical on every host."""
    return key if isinstance(key, str) else str(key)


def cap(text: str, limit: int) -> str:
    """Truncate ``text`` to ``limit`` characters, marking the cut with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026" if limit > 0 else ""


def task_span_id(carrier: trace.SpanContext, key: str) -> int:
    """Span id of the ``task`` span for ``key`` under the task's ``carrier`` (never 0).

    The carrier is the context in the task's annotation (the submitting client's span,
    or the scheduler's ``graph`` span): a key computed again by a later submission in
    the same trace gets a new id.
    """
    digest = hashlib.blake2b(
        key.encode("utf-8", "surrogatepass"),
        digest_size=8,
        key=carrier.trace_id.to_bytes(16, "big") + carrier.span_id.to_bytes(8, "big"),
    ).digest()
    return int.from_bytes(digest, "big") or 1


def keep_task(carrier: trace.SpanContext, key: str, ratio: float) -> bool:
    """Whether ``key`` gets per-task spans when a share ``ratio`` of its graph does.

    A deterministic hash (the task span id itself), so every process could agree; the
    scheduler decides, and tells workers through the sampled flag of the task's carrier.
    """
    return ratio >= 1 or task_span_id(carrier, key) < ratio * 2**64


def with_sampled(span_context: trace.SpanContext, sampled: bool) -> trace.SpanContext:
    """``span_context`` with its sampled flag set to ``sampled``."""
    flags = trace.TraceFlags(
        (span_context.trace_flags | trace.TraceFlags.SAMPLED)
        if sampled
        else (span_context.trace_flags & ~trace.TraceFlags.SAMPLED)
    )
    return trace.SpanContext(
        span_context.trace_id,
        span_context.span_id,
        is_remote=span_context.is_remote,
        trace_flags=flags,
        trace_state=span_context.trace_state,
    )


def task_link(carrier: trace.SpanContext, key: str, relation: str) -> trace.Link:
    """A link to the ``task`` span of ``key`` (``dask.link`` says how it relates)."""
    span_id = task_span_id(carrier, key)
    context = trace.SpanContext(carrier.trace_id, span_id, False, carrier.trace_flags)
    return trace.Link(context, {"dask.link": relation})


def encode(span_context: trace.SpanContext) -> str:
    """The ``traceparent`` header value for ``span_context``."""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags):02x}"
    )


def decode(value: object) -> trace.SpanContext | None:
    """Parse a ``traceparent`` from an annotation; None for anything else (never raises)."""
    return _decode_traceparent(value) if isinstance(value, str) else None


def thinned(value: object) -> bool:
    """Whether an annotation marks a task thinned out of a sampled trace."""
    return isinstance(value, str) and value.endswith(THINNED)


#: Carriers parsed and kept: every task of a graph carries the same one, so this is the
#: number of graphs (sampled and thinned variants apart) a process can work on at once
#: without parsing again. Each entry holds ~0.3 kB until evicted.
DECODED_CARRIERS = 64


@functools.lru_cache(maxsize=DECODED_CARRIERS)
def _decode_traceparent(value: str) -> trace.SpanContext | None:
    span_context = trace.get_current_span(
        _propagator.extract({"traceparent": value.removesuffix(THINNED)})
    ).get_span_context()
    return span_context if span_context.is_valid else None


def traced_task(annotations: dict | None, key: Any) -> tuple[trace.SpanContext, str] | None:
    """(carrier, key text) of a task whose spans are recorded (from a worker's
    ``TaskState.annotations``), else None."""
    carrier = decode(annotations.get(ANNOTATION)) if annotations else None
    if carrier is None or not carrier.trace_flags.sampled:
        return None
    return carrier, key_to_str(key)


def task_context(carrier: trace.SpanContext, key: str) -> Context:
    """A context whose current span is the (remote) ``task`` span of ``key``."""
    parent = trace.SpanContext(
        trace_id=carrier.trace_id,
        span_id=task_span_id(carrier, key),
        is_remote=True,
        trace_flags=carrier.trace_flags,
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


class _PresetIdGenerator:
    """Wraps an SDK tracer's id generator so one span at a time can get a chosen id.

    The OpenTelemetry API has no way to start a span with a given id; the SDK asks its
    tracer's ``id_generator`` exactly once per span, so a thread-local preset is enough.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.local = threading.local()

    def generate_span_id(self) -> int:
        preset = getattr(self.local, "span_id", None)
        if preset is not None:
            self.local.span_id = None
            return preset
        return self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return getattr(self.inner, "is_trace_id_random", lambda: False)()


class SpanIdSetter:
    """Starts spans with a preset span id on tracers that allow it (the SDK's do)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        generator = getattr(tracer, "id_generator", None)
        if isinstance(generator, _PresetIdGenerator):
            self._generator: _PresetIdGenerator | None = generator
        elif generator is not None and hasattr(generator, "generate_span_id"):
            self._generator = _PresetIdGenerator(generator)
            tracer.id_generator = self._generator  # type: ignore[attr-defined]
        else:
            self._generator = None
            if not isinstance(tracer, (trace.NoOpTracer, trace.ProxyTracer)):
                logger.warning(
                    "dask-otel: tracer %r cannot take preset span ids; spans of one task "
                    "recorded on different hosts will not share a parent",
                    type(tracer).__name__,
                )

    def start_span(self, span_id: int | None, name: str, **kwargs: Any) -> trace.Span:
        """``tracer.start_span(name, **kwargs)`` with ``span_id`` as the new span's id
        (None: the tracer draws one)."""
        if self._generator is not None:
            self._generator.local.span_id = span_id
        try:
            return self.tracer.start_span(name, **kwargs)
        finally:
            if self._generator is not None:
                self._generator.local.span_id = None
