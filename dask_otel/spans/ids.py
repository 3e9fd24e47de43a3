"""Deterministic span ids and the trace context that travels beside a task's annotations.

The trace context of a task (its :class:`Carrier`, text form ``traceparent;g=N...``)
never shows in what users see of their annotations. It travels under the reserved name
:data:`ANNOTATION` only between dask-otel's own hands: the client sends it as a global
annotation of the submission, the scheduler plugin takes it out of the ``update-graph``
message before Dask reads the annotations, keeps each task's carrier in a dict of its
own and adds it to the annotations of the ``compute-task`` message (a copy), and the
worker plugin takes it out again before Dask's worker reads the message
(:class:`TaskCarriers`). A process without dask-otel passes it on untouched, so a plain
scheduler still carries the client's context to instrumented workers.

The span id of a task's ``task`` span is a hash of (that trace context, key): the
scheduler, the worker that runs it and any worker that moves its data all name the same
parent without waiting for each other.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import weakref
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dask_otel.strings import key_to_str

#: Name of the annotation that carries the trace context from the client to the
#: scheduler and from the scheduler to the worker (reserved: a user's own is replaced).
ANNOTATION = "otel"
#: Options appended to the ``traceparent`` in a task's annotation (see :class:`Carrier`).
THINNED = ";thinned"
_GENERATION = ";g="
_PARTIAL = ";partial"
_LINKS = ";links="
_FROM_CLIENT = ";client"

_propagator = TraceContextTextMapPropagator()
logger = logging.getLogger(__name__)


def task_span_id(carrier: trace.SpanContext, key: str, generation: int = 0) -> int:
    """Span id of the ``task`` span for ``key`` in ``generation`` under ``carrier`` (never 0).

    The carrier is the context in the task's annotation (the scheduler's ``graph`` span):
    a key computed again by a later submission in the same trace gets a new id. The
    generation is 0 until an attempt ends without a result (see :class:`Carrier`); the
    attempt that runs in generation ``g`` is current in its thread with this id, and is
    emitted with it: as the ``task`` span if it produced the result, as an ``attempt``
    span beside it (under the same parent, linked from the later span) if it did not.
    """
    text = key if not generation else f"{key}\x00{generation}"
    hasher = _keyed_hasher(carrier.trace_id, carrier.span_id).copy()
    hasher.update(text.encode("utf-8", "surrogatepass"))
    return int.from_bytes(hasher.digest(), "big") or 1


@functools.lru_cache(maxsize=64)
def _keyed_hasher(trace_id: int, span_id: int) -> Any:
    """The hash of nothing yet, keyed by a carrier: copied for each key (every task of a
    graph has the same carrier, and keying is most of the cost of a short key's hash)."""
    return hashlib.blake2b(
        digest_size=8, key=trace_id.to_bytes(16, "big") + span_id.to_bytes(8, "big")
    )


def attempt_span_id(annotation: object, key: Any) -> tuple[int, int] | None:
    """(trace id, span id) of the attempt at ``key`` that runs with ``annotation`` (the
    task's ``otel`` annotation when the attempt started), or None if it is not traced.

    Any process that saw the annotation can name the attempt: the worker running it (its
    current span), the scheduler reporting it lost with its worker, a Nanny recording why
    that worker died. Only the worker (if it finished the attempt) or the scheduler (if
    the worker died) emits a span with it.
    """
    carrier = parse(annotation)
    if carrier is None:
        return None
    return carrier.context.trace_id, task_span_id(
        carrier.context, key_to_str(key), carrier.generation
    )


def keep_task(carrier: trace.SpanContext, key: str, ratio: float) -> bool:
    """Whether ``key`` gets per-task spans when a share ``ratio`` of its graph does.

    A deterministic hash (the task span id itself), so every process could agree; the
    scheduler decides, and tells workers through the sampled flag of the task's carrier.
    """
    return ratio >= 1 or task_span_id(carrier, key) < ratio * 2**64


def with_sampled(span_context: trace.SpanContext, sampled: bool) -> trace.SpanContext:
    """``span_context`` with its sampled flag set to ``sampled``."""
    if span_context.trace_flags.sampled is sampled:
        return span_context
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


def encode(span_context: trace.SpanContext) -> str:
    """The ``traceparent`` header value for ``span_context``."""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags):02x}"
    )


def decode(value: object) -> trace.SpanContext | None:
    """The trace context of an annotation; None for anything else (never raises)."""
    carrier = parse(value)
    return carrier.context if carrier is not None else None


class Carrier(NamedTuple):
    """A task's ``otel`` annotation, parsed: what every process that touches the task
    needs to name its spans, written by the scheduler (``encode``) and shipped by Dask.

    Text form: ``<traceparent>[;g=N][;thinned][;partial][;client]``
    ``[;links=<trace>-<span>,...]``.
    """

    #: The ``graph`` span (or, for a client's own annotation, the submitting span); its
    #: sampled flag says whether the task is traced.
    context: trace.SpanContext
    #: Attempts that ended without a result so far (a failure, a reschedule, a worker
    #: lost, a cancellation) and results lost since: every one moves the task to a new
    #: span id, so no id is emitted twice.
    generation: int = 0
    #: Thinned out of a sampled trace: its worker reports it only if slow or failed.
    thinned: bool = False
    #: The graph is thinned: a dependency may have no span to link to.
    partial: bool = False
    #: Span contexts of the dependencies' task spans, when the scheduler named them
    #: (dependencies from other graphs); None: the worker derives them from the keys.
    links: tuple[trace.SpanContext, ...] | None = None
    #: Written by the submitting client, and no dask-otel scheduler replaced it: no one
    #: moves the task to new generations, so its worker gives each attempt an id of its own.
    from_client: bool = False

    def span_id(self, key: str) -> int:
        """This generation's span id for ``key``."""
        return task_span_id(self.context, key, self.generation)

    def encode(self) -> str:
        parts = [encode(self.context)]
        if self.generation:
            parts.append(f"{_GENERATION}{self.generation}")
        if self.thinned:
            parts.append(THINNED)
        if self.partial:
            parts.append(_PARTIAL)
        if self.from_client:
            parts.append(_FROM_CLIENT)
        if self.links is not None:
            parts.append(
                _LINKS + ",".join(f"{c.trace_id:032x}-{c.span_id:016x}" for c in self.links)
            )
        return "".join(parts)


#: Carriers parsed and kept: every task of a graph carries the same one, so this is the
#: number of graphs (sampled and thinned variants apart) a process can work on at once
#: without parsing again. Each entry holds ~0.5 kB until evicted.
DECODED_CARRIERS = 64


def parse(value: object) -> Carrier | None:
    """The :class:`Carrier` of an annotation; None for anything else (never raises: a
    user's own ``otel`` annotation can be of any type)."""
    return _parse(value) if type(value) is str else None


def parsed_carriers(clear: bool = False) -> int:
    """How many parsed carriers this process keeps (at most :data:`DECODED_CARRIERS`);
    ``clear`` forgets them (a benchmark measuring what is not bounded)."""
    held = _parse.cache_info().currsize
    if clear:
        _parse.cache_clear()
    return held


@functools.lru_cache(maxsize=DECODED_CARRIERS)
def _parse(value: str) -> Carrier | None:
    traceparent, *options = value.split(";")
    span_context = trace.get_current_span(
        _propagator.extract({"traceparent": traceparent})
    ).get_span_context()
    if not span_context.is_valid:
        return None
    fields: dict[str, Any] = {}
    for option in options:
        name, _, argument = option.partition("=")
        if name == "g" and argument.isdigit():
            fields["generation"] = int(argument)
        elif name in ("thinned", "partial"):
            fields[name] = True
        elif name == "client":
            fields["from_client"] = True
        elif name == "links":
            flags = span_context.trace_flags
            try:
                fields["links"] = tuple(_link(link, flags) for link in argument.split(",") if link)
            except ValueError:
                return None
        else:
            return None  # not ours
    return Carrier(span_context, **fields)


def _link(text: str, flags: trace.TraceFlags) -> trace.SpanContext:
    trace_id, _, span_id = text.partition("-")
    return trace.SpanContext(int(trace_id, 16), int(span_id, 16), True, flags)


class TaskRef(NamedTuple):
    """A traced task as the worker holding it knows it: enough to name its span."""

    carrier: Carrier
    #: The key's text (:func:`key_to_str`).
    key: str

    @property
    def span_context(self) -> trace.SpanContext:
        """The (remote) context of this generation's span of the task."""
        context = self.carrier.context
        return trace.SpanContext(
            context.trace_id,
            self.carrier.span_id(self.key),
            is_remote=True,
            trace_flags=context.trace_flags,
        )


def take_carrier(annotations: Any) -> tuple[Any, str | None]:
    """(``annotations`` without dask-otel's carrier, the carrier), or (``annotations``,
    None) if they hold none (a user's own ``otel`` value of any type stays where it is).

    A copy, never the dict itself: in one process a message is the sender's own object
    (an in-process worker gets the scheduler's dict).
    """
    if type(annotations) is not dict or ANNOTATION not in annotations:
        return annotations, None
    value = annotations[ANNOTATION]
    if parse(value) is None:
        return annotations, None
    return {name: v for name, v in annotations.items() if name != ANNOTATION}, value


class TaskCarriers:
    """The carrier of each task a worker was sent, kept by its ``TaskState`` (and gone
    with it) instead of in the task's annotations, which are the user's."""

    def __init__(self) -> None:
        self._by_task: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        #: When the worker began fetching each task's inputs (ns), until it runs the task.
        self._fetching_since: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def set(self, ts: Any, annotation: str) -> None:
        self._by_task[ts] = annotation

    def fetching(self, ts: Any, start_ns: int) -> None:
        """The worker began fetching inputs of ``ts`` (its first fetch counts)."""
        self._fetching_since.setdefault(ts, start_ns)

    def taken_up(self, ts: Any, now_ns: int) -> int:
        """When the attempt at ``ts`` starting now began: at its first input fetch, so
        that the task's span covers the ``transfer`` spans under it."""
        return min(self._fetching_since.pop(ts, now_ns), now_ns)

    def get(self, ts: Any) -> Any:
        """The carrier ``ts`` runs with; for a task sent before dask-otel's plugin was
        set up on this worker, the one still in its annotations (or None)."""
        annotation = self._by_task.get(ts)
        if annotation is None and ts.annotations:
            return ts.annotations.get(ANNOTATION)
        return annotation

    def traced(self, ts: Any) -> TaskRef | None:
        """The :class:`TaskRef` of ``ts`` if its spans are recorded, else None."""
        return task_ref(self.get(ts), ts.key)


def task_ref(annotation: object, key: Any) -> TaskRef | None:
    """The :class:`TaskRef` of a task whose ``otel`` annotation is ``annotation`` if its
    spans are recorded, else None."""
    carrier = parse(annotation)
    if carrier is None or not carrier.context.trace_flags.sampled:
        return None
    return TaskRef(carrier, key_to_str(key))


def task_context(task: TaskRef) -> Context:
    """A context whose current span is the (remote) span of ``task``."""
    return trace.set_span_in_context(trace.NonRecordingSpan(task.span_context))


#: Earlier attempts a task's span links to: the latest ones.
MAX_EARLIER_ATTEMPT_LINKS = 8


def earlier_attempt_links(
    context: trace.SpanContext, key: str, generation: int
) -> list[trace.Link]:
    """Links from the span of ``key``'s attempt in ``generation`` to the ``attempt`` spans
    of the generations before it, which lie beside it: each ended before the next began,
    so none can be another's parent."""
    first = max(0, generation - MAX_EARLIER_ATTEMPT_LINKS)
    return [
        trace.Link(
            trace.SpanContext(
                context.trace_id,
                task_span_id(context, key, earlier),
                True,
                trace.TraceFlags(trace.TraceFlags.SAMPLED),
            ),
            {"dask.link": "earlier-attempt"},
        )
        for earlier in range(first, generation)
    ]


def task_link(task: TaskRef, relation: str) -> trace.Link:
    """A link to the span of ``task`` (``dask.link`` says how it relates)."""
    return trace.Link(task.span_context, {"dask.link": relation})


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
