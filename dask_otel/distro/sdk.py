"""The one place dask-otel sets up the OpenTelemetry SDK.

``configure`` builds tracer, meter and logger providers from the standard ``OTEL_*``
variables (the SDK's own configurator does the reading), with OTLP as the default
exporter of all three signals, export queues of its own, sized for Dask's task rates and
bounded in memory, and export batches that fit a collector's 4 MiB message limit; the
spans and log records its processors lose anyway are counted
(``dask_otel.exporter.dropped``), said once in the log, and at exit said once on stderr.
Its flushes and its exit wait no longer than the collector answers. It names the process
after its Dask role, unless the user named it: a process started as ``dask-worker`` is
``dask-nanny`` (or ``dask-worker`` with ``--no-nanny``), and a process that turns out later
to host a worker or client (a Nanny's child) is named then. The SDK gives every process,
forked ones included, its own ``service.instance.id``. Providers someone else configured
are never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import logging
import os
import re
import socket
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from time import time_ns
from typing import Any

from opentelemetry import _logs, metrics, trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import (
    _SUPPRESS_INSTRUMENTATION_KEY,
    Context,
    attach,
    detach,
    set_value,
)
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk._configuration import _initialize_components, _OTelSDKConfigurator
from opentelemetry.sdk._logs import LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, Tracer
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from dask_otel import runtime
from dask_otel.distro import otlp, sanitize
from dask_otel.runtime import report_once, say_once, start_daemon
from dask_otel.spans import errors

logger = logging.getLogger(__name__)

#: Directory for the ``otlp_json_file`` exporters' files (``dask-otel demo`` sets it).
FILE_EXPORT_DIR = "DASK_OTEL_FILE_EXPORT_DIR"

SERVICE_NAMES = {
    "scheduler": "dask-scheduler",
    "worker": "dask-worker",
    "nanny": "dask-nanny",
    "client": "dask-client",
}

#: Defaults applied with ``os.environ.setdefault``, as opentelemetry-distro does: the
#: user's own values win, and child processes (Nanny workers) see the same settings.
ENV_DEFAULTS = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_LOGS_EXPORTER": "otlp",
    # The SDK's 2048-span queue overflows at Dask's task rates (a scheduler emits one
    # `task` span per task): a larger queue absorbs bursts without dropping.
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BLRP_MAX_QUEUE_SIZE": "16384",
    # One export request must stay under the collector's (and gRPC's) 4 MiB message
    # limit, or the whole batch is retried until the timeout and lost. Spans of failed
    # tasks carry messages and stacks (up to ~6 kB at the default attribute caps):
    # 2048 of them made 5 MiB requests; 512 (the SDK's default batch) stays under 4 MiB.
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512",
    "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "512",
}


@dataclass
class _Owned:
    """The providers dask-otel configured, and the Dask role their resource names.

    ``role`` is None until this process is known to be a scheduler, worker, nanny or
    client (e.g. a Nanny's spawned child, configured by ``opentelemetry-instrument``
    before it becomes a worker), and again in a forked child.
    """

    providers: tuple[object, ...]
    role: str | None


_owned: _Owned | None = None


def infer_role(argv: list[str]) -> str | None:
    """The Dask role of a process started with ``argv``, when its command line tells."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program == "__main__.py" and os.path.basename(os.path.dirname(argv[0])) == "dask":
        program = "dask"  # python -m dask ...
    args = argv[1:]
    if program == "dask" and args:
        program, args = f"dask-{args[0]}", args[1:]
    if program == "dask-scheduler":
        return "scheduler"
    if program == "dask-worker":
        return "worker" if "--no-nanny" in args else "nanny"
    return None


def _service_name(role: str | None) -> dict[str, str]:
    """``service.name`` for ``role``, unless the user named the service."""
    if role is None or os.environ.get("OTEL_SERVICE_NAME"):
        return {}
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    if any(pair.split("=", 1)[0].strip() == "service.name" for pair in pairs):
        return {}
    return {"service.name": SERVICE_NAMES[role]}


#: Why configuring from ``OTEL_*`` failed in this process, if it did: the process runs
#: untraced, and no later entry point (a client's every submission) tries again.
_failure: Exception | None = None


class DaskOtelConfigurator(_OTelSDKConfigurator):
    """``opentelemetry_configurator`` entry point: the SDK, configured for a Dask process."""

    def _configure(self, **kwargs):  # type: ignore[no-untyped-def]
        global _owned
        # Before the instrumentors load, SDK disabled or not: the logging instrumentation
        # (installed with dask-otel) would put its handler on the root logger, which turns
        # off what Python prints when nothing is configured (its last resort, and the
        # basicConfig of logging.warning()). dask-otel exports those records itself
        # (dask_otel.logs), from no logger's handlers; the user's "true" still wins.
        os.environ.setdefault("OTEL_PYTHON_LOG_AUTO_INSTRUMENTATION", "false")
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return
        if _multiprocessing_helper():
            return
        if runtime.is_configured():
            return
        role = kwargs.pop("role", None) or infer_role(sys.argv)
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        attributes = {**(kwargs.pop("resource_attributes", None) or {}), **_service_name(role)}
        for name, factory in _counting_processors().items():
            kwargs.setdefault(name, factory)
        try:
            directory = os.environ.get(FILE_EXPORT_DIR)
            if directory:
                kwargs["exporter_args_map"] = _file_exporter_streams(directory)
            super()._configure(resource_attributes=attributes, **kwargs)
        except Exception as e:
            # Raised here, opentelemetry-instrument would print it and load no
            # instrumentor at all: say what is wrong once, and let the process run.
            global _failure
            _failure = e
            configuration_failed(e)
            return
        _register_dropped_counter()
        _watch_metric_exporters(metrics.get_meter_provider())
        providers = (
            trace.get_tracer_provider(),
            metrics.get_meter_provider(),
            _logs.get_logger_provider(),
        )
        _owned = _Owned(providers, role)
        atexit.unregister(_shutdown_at_exit)  # once, however often this runs
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """Shut the owned providers down at exit within ``otel.flush-timeout``, then say on
    stderr what this process could not export.

    Replaces the SDK's own atexit shutdown, which waits up to 30 s per batch processor
    (and again for the metric reader) while the exporters retry against an unreachable
    or stalled collector: a SIGTERM'd scheduler would take most of a minute to exit.
    Here the wait also ends once the collector has answered nothing for a moment
    (``runtime.health``): at once, nearly, when the last export had already failed.
    """
    if _owned is None:
        return
    for provider in _owned.providers:
        atexit.unregister(provider.shutdown)  # the SDK's handler; a second call only warns
    try:
        from dask_otel.config import load_settings

        timeout = load_settings().flush_timeout
    except Exception:
        timeout = 5.0
    if runtime.exit_limit is not None:
        timeout = min(timeout, runtime.exit_limit)
    runtime.shutdown(runtime.Providers(*_owned.providers), timeout)  # type: ignore[arg-type]
    # If the shutdown gave up: no request left open for the interpreter's exit to wait on.
    for stoppable in [*_export_queues, *_metric_exporters]:
        stoppable.stop()
    _say_loss()
    # Said: the exporters' threads, which may still end a batch in failure, say no more.
    _warned.update(f"dropped {signal}" for signal in _NOUNS)


def _say_loss() -> None:
    """Say on stderr how many spans and log records this process did not
    export: lost on the way, and still queued (at exit). Nothing if all went out."""
    lost: Counter[str] = Counter()
    queues = list(_export_queues)
    with contextlib.ExitStack() as held:  # no batch moves from pending to failed meanwhile
        for queue in queues:
            held.enter_context(queue._lock)
            lost[queue.signal] += len(queue._items) + queue._in_flight
        for (signal, _), count in dropped().items():
            lost[signal] += count
    endpoints = (getattr(queue.exporter.exporter, "_endpoint", None) for queue in queues)
    destination = next((endpoint for endpoint in endpoints if endpoint), "its exporter")
    if not sum(lost.values()):
        return
    counts = ", ".join(f"{lost[signal]} {noun}" for signal, noun in _NOUNS.items() if lost[signal])
    if runtime.health.failing():
        say_once(f"collector unreachable at {destination}: {counts} not exported")
    else:
        say_once(f"{counts} not exported to {destination} (see the log)")


def _file_exporter_streams(directory: str) -> dict[type, dict[str, Any]]:
    """One OTLP JSON lines file per signal and process under ``directory``.

    Used with the ``otlp_json_file`` exporters (``OTEL_TRACES_EXPORTER=otlp_json_file``
    ...), which otherwise write to standard output. Files are named
    ``<signal>-<role>-<host>-<pid>.jsonl`` (see :class:`_RoleFile`), in the format of
    the collector's file exporter.
    """
    from opentelemetry.exporter.otlp.json.file._log_exporter import FileLogExporter
    from opentelemetry.exporter.otlp.json.file.metric_exporter import FileMetricExporter
    from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter

    return {
        FileSpanExporter: {"stream": _RoleFile(directory, "traces")},
        FileMetricExporter: {"stream": _RoleFile(directory, "metrics")},
        FileLogExporter: {"stream": _RoleFile(directory, "logs")},
    }


class _RoleFile:
    """The stream an ``otlp_json_file`` exporter writes to: a file named after the
    process's Dask role (``traces-worker-<host>-<pid>.jsonl``).

    Opened at the first line, so a process that exports nothing leaves no file; renamed
    when the process learns its role after that (a Nanny's worker process is configured
    by ``opentelemetry-instrument`` before it is a worker); opened anew in a forked
    child. A process that never has a Dask role is named after its program.
    """

    def __init__(self, directory: str, signal: str) -> None:
        self._directory = directory
        self._signal = signal
        self._file: Any = None
        self._path = ""
        self._pid = 0
        #: What the exporter checks before it writes.
        self.closed = False

    def _wanted(self) -> str:
        role = _owned.role if _owned is not None and _owned.role else _program()
        name = f"{self._signal}-{role}-{socket.gethostname()}-{os.getpid()}.jsonl"
        return os.path.join(self._directory, name)

    def write(self, text: str) -> int:
        path = self._wanted()
        if self._file is None or self._pid != os.getpid():
            os.makedirs(self._directory, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (the process's life)
            self._path, self._pid = path, os.getpid()
        elif path != self._path:
            os.replace(self._path, path)  # the process learnt its role
            self._path = path
        return int(self._file.write(text))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()


def _program() -> str:
    """A process's name when it has no Dask role: its script's, or ``python``."""
    name = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name).strip("_") or "python"


def _multiprocessing_helper() -> bool:
    """Python's own helper processes (the resource tracker, the forkserver) start from a
    Dask process's environment (``opentelemetry-instrument``'s sitecustomize included)
    but run no Dask code: they configure nothing and export nothing. (A worker forked
    from the forkserver shares its command line, not its pid.)"""
    return os.getpid() == _HELPER_PID


def _helper_pid() -> int | None:
    argv = getattr(sys, "orig_argv", [])
    code = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
    helper = "multiprocessing.resource_tracker" in code or "multiprocessing.forkserver" in code
    return os.getpid() if helper else None


#: This process's pid if it is one of Python's multiprocessing helpers.
_HELPER_PID = _helper_pid()


#: The variable that chooses the component of each entry-point group the SDK loads.
_COMPONENT_VARIABLES = {
    "opentelemetry_traces_exporter": "OTEL_TRACES_EXPORTER",
    "opentelemetry_metrics_exporter": "OTEL_METRICS_EXPORTER",
    "opentelemetry_logs_exporter": "OTEL_LOGS_EXPORTER",
    "opentelemetry_id_generator": "OTEL_PYTHON_ID_GENERATOR",
}
_UNKNOWN_COMPONENT = re.compile(r"Requested component '(.*)' not found in entry point '(.*)'")


def configuration_failed(error: Exception) -> None:
    """Say once, on one line of stderr, that a bad ``OTEL_*`` setting keeps this process
    from exporting: the variable, its value and what is installed, when the SDK's error
    tells (an exporter name that no installed package provides)."""
    unknown = _UNKNOWN_COMPONENT.search(str(error))
    group = unknown.group(2) if unknown else ""
    if group in _COMPONENT_VARIABLES:
        installed = {entry.name for entry in entry_points(group=group)}
        if group.endswith("_exporter"):
            installed.add("otlp")  # the SDK's own name for OTLP over OTEL_EXPORTER_OTLP_PROTOCOL
        problem = (
            f"{_COMPONENT_VARIABLES[group]}={unknown.group(1)} names nothing installed "
            f"(installed: {', '.join(sorted(installed))}; or none)"
        )
    else:
        problem = f"{type(error).__name__}: {error}"
    say_once(f"cannot configure OpenTelemetry: {problem}. Telemetry is off in this process.")


def configure(role: str) -> bool:
    """Make sure this process exports telemetry, named after ``role``; False if it cannot
    (configuring from ``OTEL_*`` failed, now or before: said once, not tried again).

    Configures the SDK when nothing did yet; names the providers dask-otel configured
    before the role was known; leaves other configurations alone.
    """
    if not runtime.is_configured():
        if _failure is None:
            DaskOtelConfigurator().configure(role=role)
        return _failure is None
    if _owned is not None and _owned.role is None:
        _retag(role)
    return True  # by dask-otel, or by the user (after a failure of ours, too)


def _retag(role: str) -> None:
    """Name the owned providers' resource after ``role``.

    The SDK merges a resource into its providers' own after a fork (that is how each
    process gets its ``service.instance.id``); the same merge names the role.
    """
    assert _owned is not None
    update = Resource(_service_name(role))
    for provider in _owned.providers:
        merge = getattr(provider, "_update_resource", None)
        if merge is not None:
            merge(update)
    _owned.role = role


def _after_fork_in_child() -> None:
    """A forked child (a Nanny's worker, say) has yet to say what it is."""
    if _owned is not None:
        _owned.role = None


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- lost telemetry --------------------------------------------------------------------
#
# Spans and log records are lost in two places, both silently as far as a collector can
# tell: a queue that is full drops the new item, and an exporter whose retries failed
# returns FAILURE (the SDK's batch processors ignore it). dask-otel's export queues count
# both, and the ``dask_otel.exporter.dropped`` counter reports them.

#: Spans and log records lost in this process, by (signal, reason).
_dropped: Counter[tuple[str, str]] = Counter()
_dropped_lock = threading.Lock()

#: Always reported (zero included), so the first loss shows as an increase.
_DROP_REASONS = ("queue_full", "export_failed")
_NOUNS = {"traces": "spans", "logs": "log records"}
_ADVICE = {
    "queue_full": "its export queue was full (raise {queue}, or check that the collector keeps up)",
    "export_failed": "the exporter gave up on a batch (is the collector reachable, and does "
    "it accept messages this large?)",
    "already_shutdown": "they were made after the SDK shut down",
}
_QUEUE_VARIABLES = {"traces": "OTEL_BSP_MAX_QUEUE_SIZE", "logs": "OTEL_BLRP_MAX_QUEUE_SIZE"}
#: Signals whose losses were reported (checked before the lock: one set lookup a batch).
_warned: set[str] = set()


def dropped() -> dict[tuple[str, str], int]:
    """Spans and log records lost so far in this process, by ``(signal, reason)``."""
    with _dropped_lock:
        return dict(_dropped)


def _count_dropped(signal: str, reason: str, count: int) -> None:
    """Count lost items. Cheap: called by a batch processor for each item it drops."""
    with _dropped_lock:
        _dropped[signal, reason] += count


def _warn_dropped(signal: str) -> None:
    """Say once per signal (in the exporting thread, off the hot path) what was lost."""
    if f"dropped {signal}" in _warned:
        return
    with _dropped_lock:
        lost = {reason: n for (s, reason), n in _dropped.items() if s == signal and n}
    if not lost:
        return
    _warned.add(f"dropped {signal}")
    reasons = "; ".join(
        f"{n} because {_ADVICE.get(reason, reason)}".format(queue=_QUEUE_VARIABLES[signal])
        for reason, n in sorted(lost.items())
    )
    report_once(
        logger,
        f"dropped {signal}",
        "dask-otel: %s lost: %s. Said once: from now on losses are only counted, in the "
        "dask_otel.exporter.dropped metric",
        _NOUNS[signal],
        reasons,
    )


def _observe_dropped(options: CallbackOptions) -> list[Observation]:
    counts = dropped()
    for signal in _NOUNS:
        for reason in _DROP_REASONS:
            counts.setdefault((signal, reason), 0)
    # A scheduler or worker in this process names the cluster its losses belong to.
    identity = {}
    logs = sys.modules.get("dask_otel.signals.logs")
    if logs is not None and "dask.cluster.id" in logs.identity:
        identity["dask.cluster.id"] = logs.identity["dask.cluster.id"]
    return [
        Observation(count, {**identity, "dask_otel.signal": signal, "error.type": reason})
        for (signal, reason), count in sorted(counts.items())
    ]


def _register_dropped_counter() -> None:
    """The ``dask_otel.exporter.dropped`` counter, on the meter provider just configured."""
    from dask_otel.signals.instruments import DROPPED, INSTRUMENTS
    from dask_otel.version import __version__

    spec = INSTRUMENTS[DROPPED]
    meter = metrics.get_meter_provider().get_meter(runtime.SCOPE, __version__)
    meter.create_observable_counter(
        DROPPED, callbacks=[_observe_dropped], unit=spec.unit, description=spec.description
    )


def _is_failure(result: Any) -> bool:
    return getattr(result, "name", "SUCCESS") != "SUCCESS"  # SpanExportResult.FAILURE, ...


class _CountingExporter:
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
                _NOUNS[self.signal],
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


class _CountingSpanExporter(_CountingExporter):
    """Counts lost spans; hands the exporter the queued tuples if it is the OTLP/gRPC
    exporter (which then encodes them with :mod:`dask_otel.otlp`, ~5x cheaper than the
    SDK's encoder), ReadableSpans rebuilt from them otherwise."""

    signal = "traces"
    failure = SpanExportResult.FAILURE

    def __init__(self, exporter: SpanExporter, shared: _SharedObjects, mirror: Mirror) -> None:
        super().__init__(exporter, mirror)
        self.shared = shared
        self.encodes_tuples = otlp.take_over(exporter, shared.__getitem__, shared.__getitem__)
        self.items = sanitize.Spans(shared.is_own_scope)

    def readable(self, batch: Sequence[Any]) -> Sequence[Any]:
        if self.encodes_tuples:
            return batch
        return [rebuild(values, self.shared) for values in batch]


class _CountingLogRecordExporter(_CountingExporter):
    signal = "logs"
    failure = LogRecordExportResult.FAILURE
    items = sanitize.LogRecords()


# -- export queues ----------------------------------------------------------------------
#
# dask-otel's own batch processors queue spans and log records for one daemon thread that
# exports them in batches, as the SDK's do, with three differences: the queue is bounded
# in (estimated) bytes as well as in items, so that a collector that is down does not
# grow a worker by tens of megabytes of unmanaged memory that Dask's spill and pause
# decisions then act on; a flush waits no longer than its timeout and than the collector
# keeps taking batches (runtime.health), instead of exporting the whole queue in the
# caller's thread however long the exporter retries; and what is still queued when the
# process exits is counted and said.

#: Estimated bytes of one queued span or log record: a fixed part, a part per attribute,
#: event and link, plus the characters of its strings (measured with tracemalloc on the
#: spans and records of a Dask run; see ``tests/test_span_queue.py``).
_SPAN_BYTES, _LOG_BYTES, _ATTRIBUTE_BYTES, _EVENT_BYTES, _LINK_BYTES = 450, 900, 60, 250, 350

#: Per signal: the prefix of its ``OTEL_*`` batch variables, and the SDK's defaults.
_BATCH_VARIABLES = {"traces": "OTEL_BSP_", "logs": "OTEL_BLRP_"}
_BATCH_DEFAULTS = {
    "traces": {"max_queue_size": 2048, "max_export_batch_size": 512, "schedule_delay_millis": 5000},
    "logs": {"max_queue_size": 2048, "max_export_batch_size": 512, "schedule_delay_millis": 1000},
}
#: The variable (after its prefix) of each option.
_BATCH_OPTIONS = {
    "max_queue_size": "MAX_QUEUE_SIZE",
    "max_export_batch_size": "MAX_EXPORT_BATCH_SIZE",
    "schedule_delay_millis": "SCHEDULE_DELAY",
}


def _strings(attributes: Any) -> int:
    """Characters of the string values in ``attributes`` (keys are mostly shared)."""
    if not attributes:
        return 0
    return sum(len(v) for v in attributes.values() if v.__class__ is str)


def _span_size(values: CompactSpan) -> int:
    """Estimated bytes a queued span holds (see :func:`compact`)."""
    attributes, events, links = values[10], values[11], values[12]
    size = _SPAN_BYTES + len(values[0]) + _strings(attributes)
    size += _ATTRIBUTE_BYTES * len(attributes or ())
    for _, _, event_attributes in events:
        size += _EVENT_BYTES + _ATTRIBUTE_BYTES * len(event_attributes or ())
        size += _strings(event_attributes)
    return size + _LINK_BYTES * len(links)


def _log_size(record: Any) -> int:
    """Estimated bytes a queued log record holds."""
    log = record.log_record
    body = log.body
    if body.__class__ is str:
        size = _LOG_BYTES + len(body)
    elif isinstance(body, dict):  # an event record: Dask's own message
        size = _LOG_BYTES + _ATTRIBUTE_BYTES * len(body) + _strings(body)
    else:
        size = _LOG_BYTES + _ATTRIBUTE_BYTES
    attributes = log.attributes
    return size + _ATTRIBUTE_BYTES * len(attributes or ()) + _strings(attributes)


@dataclass(frozen=True)
class QueueLimits:
    """How much an :class:`ExportQueue` holds, and how it batches."""

    max_items: int
    max_bytes: int
    batch: int
    delay: float  #: seconds between scheduled exports


def _limits(signal: str, max_bytes: int | None, **options: Any) -> QueueLimits:
    """``options`` (``max_queue_size``, ``max_export_batch_size``,
    ``schedule_delay_millis``), else the ``OTEL_BSP_*``/``OTEL_BLRP_*`` variables, else the
    SDK's defaults; ``max_bytes``, else ``otel.max-queue-memory``."""
    unknown = set(options) - set(_BATCH_OPTIONS) - {"export_timeout_millis"}
    if unknown:
        raise TypeError(f"unknown batch processor options: {sorted(unknown)}")
    values = {
        name: _env_int(_BATCH_VARIABLES[signal] + variable, _BATCH_DEFAULTS[signal][name])
        if options.get(name) is None
        else options[name]
        for name, variable in _BATCH_OPTIONS.items()
    }
    size, batch, delay = values.values()
    if min(size, batch, delay) <= 0 or batch > size:
        raise ValueError(
            f"{signal} batch settings must be positive, the batch no larger than the queue: "
            f"{values}"
        )
    if max_bytes is None:
        max_bytes = _queue_memory()
    return QueueLimits(size, max_bytes, batch, delay / 1000)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        report_once(
            logger, name, "dask-otel: %s must be an integer, got %r; using %d", name, value, default
        )
        return default


def _queue_memory() -> int:
    """``otel.max-queue-memory`` (its default if the ``otel`` config is invalid: that is
    said where dask-otel activates)."""
    from dask_otel.config import ConfigError, load_settings

    try:
        return load_settings().max_queue_memory
    except ConfigError:
        return DEFAULT_QUEUE_MEMORY


#: ``otel.max-queue-memory``'s default, also in ``otel.yaml``.
DEFAULT_QUEUE_MEMORY = 16 * 2**20


class ExportQueue:
    """Spans or log records waiting for export, and the daemon thread that exports them.

    Bounded in items and in estimated bytes: an item that does not fit is dropped (and
    counted, ``queue_full``); the queue keeps the older ones. The thread exports a batch
    when one is full, every ``delay`` seconds, and at once for a :meth:`flush`.
    """

    def __init__(
        self,
        exporter: Any,
        signal: str,
        limits: QueueLimits,
        size: Callable[[Any], int],
    ) -> None:
        self.exporter = exporter
        self.signal = signal
        self.limits = limits
        self._size = size
        self._items: deque[Any] = deque()
        self._sizes: deque[int] = deque()
        #: Estimated bytes queued, items ever accepted, items whose export has returned,
        #: and items in the export under way.
        self.bytes = 0
        self._accepted = 0
        self._done = 0
        self._in_flight = 0
        #: Flushes want every item accepted up to this number exported now.
        self._wanted = 0
        self._closed = False  #: accepts nothing more; exports what it holds, then stops
        self._stopped = False  #: takes no more batches (shutdown gave up waiting)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Started now, as the SDK's are: a thread that first appears while Dask runs
        # looks leaked to whoever compares threads before and after (distributed's tests).
        self._thread: threading.Thread | None = None
        self._start()
        runtime.health.watched = True
        _export_queues.add(self)

    def put(self, item: Any) -> bool:
        """Queue ``item`` unless it does not fit (counted as dropped); never blocks."""
        size = self._size(item)
        with self._lock:
            if self._closed:
                reason = "already_shutdown"
            elif (
                len(self._items) >= self.limits.max_items
                or self.bytes + size > self.limits.max_bytes
            ):
                reason = "queue_full"
            else:
                self._items.append(item)
                self._sizes.append(size)
                self.bytes += size
                self._accepted += 1
                if len(self._items) >= self.limits.batch:
                    self._changed.notify()
                if self._thread is None:
                    self._start()
                return True
        _count_dropped(self.signal, reason, 1)
        return False

    def flush(self, timeout: float) -> bool:
        """Export everything queued so far; wait at most ``timeout`` seconds, and no longer
        than the collector keeps taking batches. True if all was exported (or failed)."""
        with self._lock:
            target = self._accepted
            self._wanted = max(self._wanted, target)
            self._changed.notify_all()
            if self._thread is None and self._items:
                self._start()
        return self._wait(target, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Export what is queued (waiting as :meth:`flush` does), then shut the exporter down."""
        with self._lock:
            self._closed = True
            target = self._accepted
            self._changed.notify_all()
            if self._thread is None and self._items:
                self._start()
        self._wait(target, timeout)
        self.stop()

    def stop(self) -> None:
        """Take no more batches and shut the exporter down, which aborts the OTLP
        exporters' retries and open requests (else the interpreter's exit waits for them).
        What is left stays queued: the exit counts it as not exported."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = self._closed = True
            self._changed.notify_all()
        _warn_dropped(self.signal)
        try:
            self.exporter.shutdown()
        except Exception:
            logger.debug("dask-otel: %s exporter shutdown failed", self.signal, exc_info=True)

    def _wait(self, target: int, timeout: float) -> bool:
        started = time.monotonic()
        deadline = started + timeout
        patience = runtime.health.patience()
        with self._lock:
            while self._done < target:
                stop = min(deadline, runtime.health.give_up_at(started, patience))
                remaining = stop - time.monotonic()
                if remaining <= 0:
                    runtime.health.gave_up()
                    return False
                self._changed.wait(remaining)
        return True

    def _start(self) -> None:
        """Start the exporting thread (the lock held, or not yet shared); if the
        interpreter cannot, say so once and keep the items for the next ``put`` to try
        again."""
        name = f"dask-otel-export-{self.signal}"
        self._thread = start_daemon(logger, self._run, name, f"exporting {_NOUNS[self.signal]}")

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._export(batch)

    def _next_batch(self) -> list[Any] | None:
        """Wait until a batch is due (full, flushed, scheduled or closing) and take it;
        None once closed and empty, or stopped."""
        limits = self.limits
        due = time.monotonic() + limits.delay
        with self._lock:
            while not self._stopped:
                items = len(self._items)
                if items >= limits.batch or (
                    items and (self._closed or self._wanted > self._done or time.monotonic() >= due)
                ):
                    count = min(limits.batch, items)
                    batch = [self._items.popleft() for _ in range(count)]
                    self.bytes -= sum(self._sizes.popleft() for _ in range(count))
                    self._in_flight = count
                    return batch
                if self._closed:
                    break
                if not items:
                    due = time.monotonic() + limits.delay
                self._changed.wait(max(0.0, due - time.monotonic()))
            self._thread = None
            return None

    def _export(self, batch: list[Any]) -> None:
        _warn_dropped(self.signal)  # queue drops since the last batch
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        runtime.health.started()
        lost = len(batch)
        try:
            self.exporter.export(batch)
            lost = self.exporter.lost
        except Exception:
            report_once(
                logger,
                f"export raised {self.signal}",
                "dask-otel: exporting %s raised; the batch is lost (said once)",
                _NOUNS[self.signal],
            )
        finally:
            runtime.health.finished(lost < len(batch))  # the collector took some
            detach(token)
        with self._lock:  # counted and no longer in flight at once (see _say_loss)
            if lost:
                _count_dropped(self.signal, "export_failed", lost)
            self._done += len(batch)
            self._in_flight = 0
            self._changed.notify_all()
        if lost:
            _warn_dropped(self.signal)

    def _forget_parent(self) -> None:
        """In a forked child: what the parent queued is the parent's to export, and the
        parent's thread is not here."""
        self._items.clear()
        self._sizes.clear()
        self.bytes = self._in_flight = 0
        self._accepted = self._done = self._wanted = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = None
        if not self._stopped:
            self._start()


class _WatchedMetricExporter:
    """A metric reader's exporter whose exports ``runtime.health`` hears of (a Nanny's
    process exports metrics only), and which the exit stops as it stops the queues."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._exporter, name)

    def export(self, *args: Any, **kwargs: Any) -> Any:
        if self._stopped:  # the reader's last collection, after the exit stopped this
            return MetricExportResult.FAILURE
        runtime.health.started()
        ok = False
        try:
            result = self._exporter.export(*args, **kwargs)
            ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
            return result
        finally:
            runtime.health.finished(ok)

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        if not self._stopped:
            self._stopped = True
            self._exporter.shutdown(*args, **kwargs)

    def stop(self) -> None:
        try:
            self.shutdown()
        except Exception:
            logger.debug("dask-otel: metric exporter shutdown failed", exc_info=True)


#: The metric readers' exporters of the meter provider dask-otel configured.
_metric_exporters: list[_WatchedMetricExporter] = []


def _watch_metric_exporters(provider: Any) -> None:
    """Wrap the exporter of each of ``provider``'s periodic readers (the SDK offers no
    hook for it: with a reader laid out differently, its exports go unwatched)."""
    readers = getattr(provider, "_metric_readers", ())
    for reader in readers:
        exporter = getattr(reader, "_exporter", None)
        if exporter is not None and not isinstance(exporter, _WatchedMetricExporter):
            reader._exporter = watched = _WatchedMetricExporter(exporter)
            _metric_exporters.append(watched)


#: Every export queue of this process: forgotten after fork, counted at exit.
_export_queues: weakref.WeakSet[ExportQueue] = weakref.WeakSet()


def _forget_parent_queues() -> None:
    for queue in list(_export_queues):
        queue._forget_parent()


os.register_at_fork(after_in_child=_forget_parent_queues)


# -- spans waiting for export ------------------------------------------------------------
#
# A span the SDK has ended is a dozen objects the garbage collector tracks. In a batch
# queue they live long enough (until a batch is ready) to reach its oldest generation, and
# every few thousand of them trigger a full collection: a walk over all of Dask's own
# objects, a large part of a second on a scheduler holding a large graph. The processor
# dask-otel configures queues each span as one flat tuple of plain values instead (the
# tuple is the one object the collector tracks: its attribute dicts and everything else
# in it are not), and builds the ReadableSpan again for the exporter, field for field as
# OTLP encodes it.

#: A queued span: name, trace id, span id, flags, trace state, parent (span id, or None
#: for a root; its remote flag), resource and scope (by number), kind, attributes, events,
#: links, status code and description, start, end, and the counts of attributes, events
#: and links dropped. (A parent shares the span's trace id; OTLP sends only its span id
#: and remote flag.)
CompactSpan = tuple


def _trace_state_values(context: SpanContext) -> tuple | None:
    return tuple(context.trace_state.items()) if context.trace_state else None


def _trace_state(values: tuple | None) -> TraceState | None:
    return TraceState(values) if values else None


def _plain(attributes: Any) -> dict | None:
    """(Already cleaned) attributes as a plain dict, which the collector does not track
    while its values are scalars or tuples of them."""
    if not attributes:
        return None
    try:
        # The SDK's BoundedAttributes (also behind the span's MappingProxyType) copies its
        # dict at C speed; ``dict()`` would go key by key through the Mapping protocol.
        return attributes.copy()
    except AttributeError:
        return dict(attributes)


class _RebuiltSpan(ReadableSpan):
    """A queued span made readable again, with the counts of what its limits dropped."""

    def __init__(self, dropped: tuple[int, int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._dropped = dropped

    @property
    def dropped_attributes(self) -> int:
        return self._dropped[0]

    @property
    def dropped_events(self) -> int:
        return self._dropped[1]

    @property
    def dropped_links(self) -> int:
        return self._dropped[2]


class _SharedObjects:
    """Numbers the few resources and scopes a process has, so queued spans hold ints."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._objects: list[Any] = []
        self._lock = threading.Lock()

    def number(self, obj: Any) -> int:
        index = self._index.get(id(obj))
        if index is None:
            with self._lock:
                index = self._index.get(id(obj))
                if index is None:
                    # Kept alive with its number, so that its id is never reused.
                    index = len(self._objects)
                    self._objects.append(obj)
                    self._index[id(obj)] = index
        return index

    def __getitem__(self, index: int) -> Any:
        return self._objects[index]

    def is_own_scope(self, index: int) -> bool:
        """Whether scope ``index`` is dask-otel's (whose spans redact at the source)."""
        return getattr(self._objects[index], "name", None) == runtime.SCOPE


class _Queued:
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


class _CompactSpanProcessor(_Queued, SpanProcessor):
    """Queues each ended, sampled span as one tuple of plain values (see :func:`compact`).
    The exporter gets the tuples if it is the OTLP/gRPC exporter (which then encodes them
    with :mod:`dask_otel.distro.otlp`, ~5x cheaper than the SDK's encoder), ReadableSpans
    rebuilt from them otherwise."""

    def __init__(self, exporter: SpanExporter, limits: QueueLimits) -> None:
        shared = _SharedObjects()
        self._shared = shared
        self.mirror = Mirror("traces")
        counting = _CountingSpanExporter(exporter, shared, self.mirror)
        self.export_queue = ExportQueue(counting, "traces", limits, _span_size)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context and span.context.trace_flags.sampled:
            self.queue(compact(span, self._shared), span.resource, span.instrumentation_scope)

    def queue(self, values: CompactSpan, resource: Resource, scope: Any) -> None:
        """Queue a span already compacted (its resource and scope numbered by this
        processor's shared objects)."""
        self._put(values, lambda recorder: recorder.span(values, resource, scope))


def compact(span: ReadableSpan, shared: _SharedObjects) -> CompactSpan:
    """``span`` as one tuple whose contents the garbage collector does not track (see
    :func:`rebuild`): one tracked object per queued span instead of a dozen."""
    return _values(
        span.name,
        span.context,
        span.parent,
        shared.number(span.resource),
        shared.number(span.instrumentation_scope),
        span.kind,
        span.attributes,
        tuple((e.name, e.timestamp, _plain(e.attributes)) for e in span.events),
        tuple(_link_values(link) for link in span.links),
        span.status,
        (span.start_time, span.end_time),
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
    )


def _values(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    resource: int,
    scope: int,
    kind: SpanKind,
    attributes: Any,
    events: tuple,
    links: tuple,
    status: Status,
    times: tuple[int | None, int | None],
    dropped: tuple[int, int, int],
) -> CompactSpan:
    """The tuple of :data:`CompactSpan`'s fields."""
    return (
        name,
        context.trace_id,
        context.span_id,
        int(context.trace_flags),
        _trace_state_values(context),
        parent.span_id if parent is not None else None,
        parent is not None and parent.is_remote,
        resource,
        scope,
        kind.value,
        _plain(attributes),
        events,
        links,
        status.status_code.value,
        status.description,
        *times,
        *dropped,
    )


def _link_values(link: Link) -> tuple:
    context = link.context
    return (
        context.trace_id,
        context.span_id,
        context.is_remote,
        int(context.trace_flags),
        _trace_state_values(context),
        _plain(link.attributes),
    )


#: Enum members by value: calling an Enum class to look one up costs a microsecond.
_SPAN_KINDS = {kind.value: kind for kind in SpanKind}
_STATUS_CODES = {code.value: code for code in StatusCode}
#: The status of almost every span, shared (a Status is immutable).
_UNSET = Status(StatusCode.UNSET)
_UNSET_CODE = StatusCode.UNSET.value


def rebuild(values: CompactSpan, shared: _SharedObjects) -> ReadableSpan:
    """The ReadableSpan :func:`compact` made ``values`` of."""
    (name, trace_id, span_id, flags, trace_state, parent_id, parent_remote) = values[:7]
    (resource, scope, kind, attributes, events, links, code, description) = values[7:15]
    start, end, *dropped = values[15:]
    trace_flags = TraceFlags(flags)
    state = _trace_state(trace_state)
    status = (
        _UNSET
        if code == _UNSET_CODE and description is None
        else Status(_STATUS_CODES[code], description)
    )
    return _RebuiltSpan(
        tuple(dropped),  # type: ignore[arg-type]
        name=name,
        context=SpanContext(trace_id, span_id, False, trace_flags, state),
        parent=SpanContext(trace_id, parent_id, parent_remote, trace_flags, state)
        if parent_id is not None
        else None,
        resource=shared[resource],
        instrumentation_scope=shared[scope],
        attributes=attributes or {},
        events=tuple(Event(n, a, t) for n, t, a in events),
        links=tuple(
            Link(SpanContext(t, s, r, TraceFlags(f), _trace_state(ts)), a)
            for t, s, r, f, ts, a in links
        ),
        kind=_SPAN_KINDS[kind],
        status=status,
        start_time=start,
        end_time=end,
    )


# -- spans written straight as tuples (lever (c) of issue 18) -------------------------------
#
# dask-otel builds most of its spans after the fact, from times and attributes noted on an
# event loop. Through ``Tracer.start_span`` each costs ~24 us (sampler, id generator,
# context, the SDK span's lock and bookkeeping, the processors' on_start and on_end), and
# dask-otel's processor then turns it into a tuple. A SpanWriter makes that tuple
# directly (~8 us), with the SDK's limits; if other processors share the provider, they
# get the ReadableSpan rebuilt from it (on_end: nothing calls their on_start).


class WrittenSpan(trace.Span):
    """A span that is over by the time it is made: what is done to it goes into plain
    values, and :meth:`end` hands them to its writer."""

    def __init__(
        self,
        writer: SpanWriter,
        name: str,
        context: SpanContext,
        parent: SpanContext,
        kind: SpanKind,
        start: int,
        attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> None:
        limits = writer.limits
        self._writer = writer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start = start
        self._attributes = BoundedAttributes(
            limits.max_span_attributes,
            attributes,
            immutable=False,
            max_value_len=limits.max_attribute_length,
        )
        self._events: list[tuple[str, int, dict | None]] = []
        self._dropped_events = 0
        links = [link for link in links if link.context.is_valid]
        kept = len(links) if limits.max_links is None else limits.max_links
        # As the SDK's bounded list: the latest are kept.
        self._links = [_link_values(link) for link in links[len(links) - kept :]] if kept else []
        self._dropped_links = len(links) - len(self._links)
        self._status = _UNSET
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes: Any) -> None:
        for key, value in attributes.items():
            self._attributes[key] = value

    def _bounded(self, limit: int | None, attributes: Any) -> dict | None:
        length = self._writer.limits.max_attribute_length
        return _plain(BoundedAttributes(limit, attributes, max_value_len=length))

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        limits = self._writer.limits
        attributes = self._bounded(limits.max_event_attributes, attributes)
        event = (name, timestamp or time_ns(), attributes)
        if limits.max_events is not None and len(self._events) >= limits.max_events:
            self._dropped_events += 1
            if not limits.max_events:
                return
            del self._events[0]  # as the SDK's bounded list: the oldest goes
        self._events.append(event)

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        limits = self._writer.limits
        if not context.is_valid:
            return
        if limits.max_links is not None and len(self._links) >= limits.max_links:
            self._dropped_links += 1
            if not limits.max_links:
                return
            del self._links[0]  # as the SDK's bounded list: the oldest goes
        self._links.append(
            _link_values(Link(context, self._bounded(limits.max_link_attributes, attributes)))
        )

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # The SDK's rules: OK is final, UNSET is ignored.
        if self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Any = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event(
            "exception", errors.exception_attributes(exception, attributes, escaped), timestamp
        )

    def end(self, end_time: int | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._writer.write(self, end_time or time_ns())

    def values(self, resource: int, scope: int, end: int) -> CompactSpan:
        """This span as :func:`compact` makes it, its resource and scope numbered so."""
        return _values(
            self._name,
            self._context,
            self._parent if self._parent.is_valid else None,
            resource,
            scope,
            self._kind,
            self._attributes,
            tuple(self._events),
            tuple(self._links),
            self._status,
            (self._start, end),
            (self._attributes.dropped, self._dropped_events, self._dropped_links),
        )


class SpanWriter:
    """Writes :class:`WrittenSpan` s of one SDK tracer into its provider's span processor:
    straight into dask-otel's queue when that is the only processor, as ReadableSpans to
    every processor's ``on_end`` otherwise."""

    def __init__(self, tracer: Any) -> None:
        self.limits = tracer._span_limits
        self._resource = tracer.resource
        self._scope = tracer._instrumentation_scope
        #: The provider's (multi) span processor, whose processors may change.
        self._processor = tracer.span_processor
        self._shared = _SharedObjects()

    def _sink(self) -> tuple[_CompactSpanProcessor | None, _SharedObjects]:
        """dask-otel's processor if it is the provider's only one now, and the objects
        that number resources and scopes for it."""
        processors = getattr(self._processor, "_span_processors", ())
        ours = processors[0] if len(processors) == 1 else None
        if isinstance(ours, _CompactSpanProcessor):
            return ours, ours._shared
        return None, self._shared

    def start(
        self,
        span_id: int,
        name: str,
        parent: SpanContext,
        kind: SpanKind,
        start: int,
        attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> WrittenSpan:
        """A span under ``parent`` (a sampled context), with ``span_id``."""
        context = SpanContext(
            parent.trace_id, span_id, False, parent.trace_flags, parent.trace_state
        )
        return WrittenSpan(self, name, context, parent, kind, start, attributes, links)

    def write(self, span: WrittenSpan, end: int) -> None:
        ours, shared = self._sink()
        values = span.values(shared.number(self._resource), shared.number(self._scope), end)
        if ours is not None:
            ours.queue(values, self._resource, self._scope)
        else:
            self._processor.on_end(rebuild(values, shared))


def span_writer(tracer: Any) -> SpanWriter | None:
    """A :class:`SpanWriter` for an enabled SDK tracer; None for any other tracer (spans
    then go through ``start_span``: the API's path, slower)."""
    if type(tracer) is not Tracer or not tracer._is_enabled():
        return None
    return SpanWriter(tracer)


def span_processor(
    exporter: SpanExporter, max_queue_memory: int | None = None, **options: Any
) -> SpanProcessor:
    """A batch span processor for ``exporter``, as dask-otel configures the SDK: a queued
    span is one tuple of plain values (see :func:`compact`), the queue holds at most
    ``max_queue_memory`` bytes (estimated; default ``otel.max-queue-memory``), and lost
    spans are counted.

    ``options`` are ``BatchSpanProcessor``'s (``max_queue_size``,
    ``max_export_batch_size``, ``schedule_delay_millis``); unset, the ``OTEL_BSP_*``
    variables apply.
    """
    return _CompactSpanProcessor(exporter, _limits("traces", max_queue_memory, **options))


class _LogProcessor(_Queued, LogRecordProcessor):
    """Queues log records (the configurator's log processor)."""

    def __init__(self, exporter: LogRecordExporter, limits: QueueLimits) -> None:
        self.mirror = Mirror("logs")
        counting = _CountingLogRecordExporter(exporter, self.mirror)
        self.export_queue = ExportQueue(counting, "logs", limits, _log_size)

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        # As the SDK's batch processor does: a readable copy, without the record's context
        # (which may hold large objects), the context of the record itself left intact.
        record = copy.copy(log_record.log_record)
        record.context = Context()
        resource = log_record.resource or Resource.create({})
        scope = log_record.instrumentation_scope
        readable = ReadableLogRecord(record, resource, scope, log_record.limits)
        self._put(readable, lambda recorder: recorder.log(compact_log(record), resource, scope))


def _log_record_processor(exporter: LogRecordExporter) -> LogRecordProcessor:
    """The configurator's processor per log exporter: batching, bounded, losses counted."""
    return _LogProcessor(exporter, _limits("logs", None))


def _configured(factory: Any) -> Any:
    """``factory``, its processors remembered as this process's export queues."""

    def make(exporter: Any) -> Any:
        processor = factory(exporter)
        _queues.append(processor)
        return processor

    return make


def _counting_processors() -> dict[str, Any]:
    """Configurator arguments that make its batch processors count what they lose."""
    accepted = inspect.signature(_initialize_components).parameters
    factories = {
        "export_span_processor": _configured(span_processor),
        "export_log_record_processor": _configured(_log_record_processor),
    }
    return {name: factory for name, factory in factories.items() if name in accepted}


# -- the flight recorder's copy of the export queues ---------------------------------------
#
# A worker supervised by a dask-otel Nanny copies each span and log record it queues for
# export into shared memory (dask_otel.signals.flight), numbered in the order of the queue, and
# notes the newest number exported so far; if the process dies, its Nanny exports those
# with a higher number. The queue is first in, first out: every record older than one
# exported has left it (exported, or dropped from a full queue).

#: The batch processors the configurator made in this process.
_queues: list[Any] = []


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
    for processor in _queues:
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
    ``(numbers, values)`` as :mod:`dask_otel.signals.flight` wrote them. Returns how many were
    handed over (none with an SDK whose processors are out of reach: said once).
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
    handed = 0
    for numbers, values in spans if span_sink is not None else ():
        values = (*values[:7], *numbers, *values[9:])
        span_sink.on_end(rebuild(values, built))  # type: ignore[arg-type]
        handed += 1
    for (resource, scope), values in logs if log_sink is not None else ():
        record = _log_record(values)
        log_sink.on_emit(
            ReadWriteLogRecord(record, built[resource], instrumentation_scope=built[scope])
        )
        handed += 1
    return handed


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
        _plain(record.attributes),
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
