"""The flight recorder's copy of the export queues, and what a dead worker had queued.

A worker supervised by a dask-otel Nanny copies each span and log record it queues for
export into shared memory (:mod:`dask_otel.postmortem.flight_recorder`), numbered in the order of
the queue, and notes the newest number exported so far; if the process dies, its Nanny
exports those with a higher number (:func:`recover`). The queue is first in, first
out: every record older than one exported has left it (exported, or dropped from a full
queue).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry import _logs, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanContext, TraceFlags

from dask_otel import runtime
from dask_otel.export.queued_spans import plain_attributes, rebuild
from dask_otel.export.span_fields import KIND, RESOURCE
from dask_otel.runtime import report_once
from dask_otel.runtime_state import ProcessState

logger = logging.getLogger(__name__)


class ConfiguredProcessors(ProcessState):
    """The batch processors the configurator made in this process, in the order made (a
    forked child keeps them: their queues forget their parent's items themselves)."""

    def __init__(self) -> None:
        self.processors: list[Any] = []


#: The one per process.
configured = runtime.own(ConfiguredProcessors())


class Mirror:
    """Where one export queue is copied: a flight recorder's ring, or nowhere (None)."""

    __slots__ = ("newest", "numbers", "recorder", "ring", "signal")

    #: Numbers kept for records that left the queue unexported (dropped), before those
    #: older than the newest exported are forgotten.
    KEEP = 4096

    def __init__(self, signal: str) -> None:
        self.signal = signal
        self.recorder: Any = None
        self.ring: Any = None
        #: Copy numbers of queued records, by ``id()`` of the queued object (alive while
        #: queued; an id reused after a drop replaces its stale entry).
        self.numbers: dict[int, int] = {}
        self.newest = -1

    def queued(self, item: Any, number: int | None) -> None:
        """``item`` was queued and copied as ``number`` (None: not copied)."""
        if number is not None:
            self.numbers[id(item)] = number

    def exported(self, batch: Sequence[Any]) -> None:
        """A batch went to the exporter and came back: its records are no longer the
        worker's to send."""
        ring = self.ring
        if ring is None:
            return
        numbers = self.numbers
        newest = max((numbers.pop(id(item), -1) for item in batch), default=-1)
        if newest > self.newest:
            self.newest = newest
            ring.note_exported(newest + 1)
        if len(numbers) > self.KEEP:
            with self.recorder.lock:
                self.numbers = {k: n for k, n in numbers.items() if n > self.newest}

    def attach(self, recorder: Any) -> None:
        self.numbers = {}
        self.newest = -1
        self.ring = recorder.spans if self.signal == "traces" else recorder.logs
        self.recorder = recorder

    def detach(self) -> None:
        self.recorder = self.ring = None


def mirror(recorder: Any) -> set[str]:
    """Copy this process's first span and log export queues to ``recorder`` (None: stop).

    Returns the signals now copied: none where dask-otel did not configure the SDK.
    """
    copied = set()
    for processor in configured.processors:
        mirror = processor.mirror
        if mirror.signal in copied:
            continue
        copied.add(mirror.signal)
        if recorder is None:
            mirror.detach()
        else:
            mirror.attach(recorder)
    return copied if recorder is not None else set()


# -- records another process queued and never exported ------------------------------------


def recover(providers: runtime.Providers, objects: list[tuple], spans: list, logs: list) -> int:
    """Export a dead worker's spans and log records (from its flight recorder) through
    this process's processors, under the worker's own resource and scopes.

    ``objects`` describe the resources and scopes that the records number; records are
    ``(numbers, values)`` as :mod:`dask_otel.postmortem.flight_recorder` wrote them.
    Returns how many were handed over (none with an SDK whose processors are out of reach:
    said once).
    """
    from opentelemetry.sdk._logs import ReadWriteLogRecord
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    built: list[Any] = [
        Resource(o[1], o[2]) if o[0] == "resource" else InstrumentationScope(*o[1:])
        for o in objects
    ]
    span_sink = getattr(providers.tracer_provider, "_active_span_processor", None)
    log_sink = getattr(providers.logger_provider, "_multi_log_record_processor", None)
    if (spans and span_sink is None) or (logs and log_sink is None):
        report_once(
            logger,
            "recover",
            "dask-otel: this OpenTelemetry SDK takes no spans or log records built "
            "elsewhere: a dead worker's unexported telemetry is not sent",
        )
    # Every record built before any is handed over: a file that only looks like a
    # recorder raises here, and nothing of it is sent.
    rebuilt = [
        rebuild((*values[:RESOURCE], *numbers, *values[KIND:]), built)  # type: ignore[arg-type]
        for numbers, values in (spans if span_sink is not None else ())
    ]
    records = [
        ReadWriteLogRecord(_log_record(values), built[r], instrumentation_scope=built[s])
        for (r, s), values in (logs if log_sink is not None else ())
    ]
    for span in rebuilt:
        span_sink.on_end(span)
    for record in records:
        log_sink.on_emit(record)
    return len(rebuilt) + len(records)


def compact_log(record: _logs.LogRecord) -> tuple:
    """A log record as a tuple of plain values (see :func:`_log_record`)."""
    severity = record.severity_number
    return (
        record.timestamp,
        record.observed_timestamp,
        record.trace_id,
        record.span_id,
        int(record.trace_flags) if record.trace_flags is not None else None,
        record.severity_text,
        severity.value if severity is not None else None,
        record.body,
        plain_attributes(record.attributes),
        getattr(record, "event_name", None),
    )


def _log_record(values: tuple) -> _logs.LogRecord:
    """The log record :func:`compact_log` made ``values`` of."""
    timestamp, observed, trace_id, span_id, flags, text, number, body, attributes, event = values
    from opentelemetry.context import Context

    context = Context()
    if trace_id and span_id:
        parent = SpanContext(trace_id, span_id, False, TraceFlags(flags or 0))
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent), context)
    return _logs.LogRecord(
        timestamp=timestamp,
        observed_timestamp=observed,
        context=context,
        severity_text=text,
        severity_number=_logs.SeverityNumber(number) if number is not None else None,
        body=body,
        attributes=attributes,
        event_name=event,
    )
