"""The span and log record processors dask-otel configures the SDK with: each feeds an
export queue (:mod:`dask_otel.export.queues`), copied to a worker's flight recorder
while one is attached (:mod:`dask_otel.export.recorder_copy`), through an exporter that counts
what it loses (:mod:`dask_otel.export.drops`).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.context import (
    Context,
)
from opentelemetry.sdk._configuration import _initialize_components
from opentelemetry.sdk._logs import LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from dask_otel import runtime
from dask_otel.export import otlp_encoding, sanitize
from dask_otel.export.abandon import abandonable, abandoned
from dask_otel.export.drops import NOUNS
from dask_otel.export.queued_spans import SharedObjects, compact, rebuild
from dask_otel.export.queues import ExportQueue, QueueLimits, queue_limits
from dask_otel.export.recorder_copy import Mirror, compact_log, configured
from dask_otel.export.sdk_names import fast_path
from dask_otel.export.sizes import log_size, span_size
from dask_otel.export.span_fields import QueuedSpan
from dask_otel.runtime import report_once

logger = logging.getLogger(__name__)


def _is_failure(result: Any) -> bool:
    return getattr(result, "name", "SUCCESS") != "SUCCESS"  # SpanExportResult.FAILURE, ...


class CountingExporter:
    """Passes batches on to ``exporter`` as requests every item of which can be encoded
    and that a collector accepts (:mod:`dask_otel.sanitize`); counts in ``lost`` the
    items of requests that failed, which its :class:`ExportQueue` adds to the process's
    count (see :func:`_say_loss`).

    One implementation for both signals: ``signal`` names which one (``traces``, ``logs``),
    ``items`` how its items are checked, ``failure`` its exporters' FAILURE.
    """

    signal: str
    items: sanitize.Spans | sanitize.LogRecords
    failure: Any

    def __init__(self, exporter: Any, mirror: Mirror) -> None:
        abandonable(exporter)
        self.exporter = exporter
        self.mirror = mirror
        #: Items of the last batch that were not exported.
        self.lost = 0

    def export(self, batch: Sequence[Any]) -> Any:
        self.lost = 0
        result = None
        try:
            for request in sanitize.requests(batch, self.items):
                sent = self._send(request)
                if result is None or _is_failure(sent):
                    result = sent
        finally:
            self.mirror.exported(batch)
        return result

    def _send(self, items: Sequence[Any]) -> Any:
        """Export ``items``. If encoding them raises all the same (a value no check
        foresaw), halve them until the items that fail are alone: only they are lost."""
        try:
            result = self.exporter.export(self.readable(items))
        except Exception as e:
            if abandoned():  # given up: its call was cut (a closed channel), not its items
                self.lost += len(items)
                return self.failure
            if len(items) > 1:
                half = len(items) // 2
                first, second = self._send(items[:half]), self._send(items[half:])
                return first if _is_failure(first) else second
            self.lost += 1
            report_once(
                logger,
                f"unexportable {self.signal}",
                "dask-otel: one of the %s could not be exported and was dropped alone (said "
                "once): %r",
                NOUNS[self.signal],
                e,
            )
            return self.failure
        if _is_failure(result):
            self.lost += len(items)
        else:
            runtime.health.progress()
        return result

    def readable(self, batch: Sequence[Any]) -> Sequence[Any]:
        """The queued items as the exporter takes them."""
        return batch

    def shutdown(self) -> None:
        self.exporter.shutdown()


class _CountingSpanExporter(CountingExporter):
    """Counts lost spans; hands the exporter the queued tuples if it is the OTLP/gRPC
    exporter (which then encodes them with :mod:`dask_otel.export.otlp_encoding`, cheaper
    than the SDK's encoder), ReadableSpans rebuilt from them otherwise."""

    signal = "traces"
    failure = SpanExportResult.FAILURE

    def __init__(self, exporter: SpanExporter, shared: SharedObjects, mirror: Mirror) -> None:
        super().__init__(exporter, mirror)
        self.shared = shared
        self.encodes_tuples = otlp_encoding.take_over(
            exporter, shared.__getitem__, shared.__getitem__
        )
        self.items = sanitize.Spans(shared.is_own_scope)

    def readable(self, batch: Sequence[Any]) -> Sequence[Any]:
        if self.encodes_tuples:
            return batch
        return [rebuild(values, self.shared) for values in batch]


class _CountingLogRecordExporter(CountingExporter):
    signal = "logs"
    failure = LogRecordExportResult.FAILURE
    items = sanitize.LogRecords()


class Queued:
    """What dask-otel's span and log record processors share: an :class:`ExportQueue`,
    copied to a worker's flight recorder while one is attached (see :class:`Mirror`)."""

    mirror: Mirror
    export_queue: ExportQueue

    def _put(self, item: Any, copy: Callable[[Any], int | None]) -> None:
        """Queue ``item``; with a recorder attached, ``copy(recorder)`` it too, in one order."""
        recorder = self.mirror.recorder
        if recorder is None:
            self.export_queue.put(item)
            return
        with recorder.lock:
            if self.export_queue.put(item):
                self.mirror.queued(item, copy(recorder))

    def shutdown(self) -> None:
        self.export_queue.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.export_queue.flush(timeout_millis / 1000)


class CompactSpanProcessor(Queued, SpanProcessor):
    """Queues each ended, sampled span as one tuple of plain values (see :func:`compact`).
    The exporter gets the tuples if it is the OTLP/gRPC exporter (which then encodes them
    with :mod:`dask_otel.export.otlp_encoding`, cheaper than the SDK's encoder), ReadableSpans
    rebuilt from them otherwise."""

    def __init__(self, exporter: SpanExporter, limits: QueueLimits) -> None:
        shared = SharedObjects()
        self._shared = shared
        self.mirror = Mirror("traces")
        counting = _CountingSpanExporter(exporter, shared, self.mirror)
        self.export_queue = ExportQueue(counting, "traces", limits, span_size)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context and span.context.trace_flags.sampled:
            self.queue(compact(span, self._shared), span.resource, span.instrumentation_scope)

    def queue(self, values: QueuedSpan, resource: Resource, scope: Any) -> None:
        """Queue a span already compacted (its resource and scope numbered by this
        processor's shared objects)."""
        self._put(values, lambda recorder: recorder.span(values, resource, scope))


def span_processor(
    exporter: SpanExporter, max_queue_memory: int | None = None, **options: Any
) -> SpanProcessor:
    """A batch span processor for ``exporter``, as dask-otel configures the SDK: a queued
    span is one tuple of plain values (see :func:`compact`), the queue holds at most
    ``max_queue_memory`` bytes (estimated; default ``otel.max-queue-memory``), and lost
    spans are counted.

    ``options`` are ``BatchSpanProcessor``'s (``max_queue_size``,
    ``max_export_batch_size``, ``schedule_delay_millis``); unset, the ``OTEL_BSP_*``
    variables apply. Where the SDK lacks what this processor relies on
    (:mod:`dask_otel.export.sdk_names`), it is the SDK's ``BatchSpanProcessor``.
    """
    if not fast_path():
        return BatchSpanProcessor(exporter, **options)
    return CompactSpanProcessor(exporter, queue_limits("traces", max_queue_memory, **options))


class _LogProcessor(Queued, LogRecordProcessor):
    """Queues log records (the configurator's log processor)."""

    def __init__(self, exporter: LogRecordExporter, limits: QueueLimits) -> None:
        self.mirror = Mirror("logs")
        counting = _CountingLogRecordExporter(exporter, self.mirror)
        self.export_queue = ExportQueue(counting, "logs", limits, log_size)

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        # As the SDK's batch processor does: a readable copy, without the record's context
        # (which may hold large objects), the context of the record itself left intact.
        record = copy.copy(log_record.log_record)
        record.context = Context()
        resource = log_record.resource or Resource.create({})
        scope = log_record.instrumentation_scope
        readable = ReadableLogRecord(record, resource, scope, log_record.limits)
        self._put(readable, lambda recorder: recorder.log(compact_log(record), resource, scope))


def log_record_processor(exporter: LogRecordExporter) -> LogRecordProcessor:
    """The configurator's processor per log exporter: batching, bounded, losses counted."""
    return _LogProcessor(exporter, queue_limits("logs", None))


def _configured(factory: Any) -> Any:
    """``factory``, its processors remembered as this process's export queues."""

    def make(exporter: Any) -> Any:
        processor = factory(exporter)
        configured.processors.append(processor)
        return processor

    return make


def counting_processors() -> dict[str, Any]:
    """Configurator arguments that make its batch processors count what they lose (none
    where the SDK lacks what they rely on: the configurator's own then)."""
    if not fast_path():
        return {}
    accepted = inspect.signature(_initialize_components).parameters
    factories = {
        "export_span_processor": _configured(span_processor),
        "export_log_record_processor": _configured(log_record_processor),
    }
    return {name: factory for name, factory in factories.items() if name in accepted}
