"""Metric readers whose thread runs only while metrics are wanted, and their exporters,
watched as the export queues are.

The SDK's periodic metric reader starts its thread when it is made, at startup: a process
that never uses Dask (a multiprocessing child, a script, any tool a traced program runs)
would run it for nothing, and distributed's tests count threads. The readers dask-otel
configures tick only while ``runtime.metric_demand`` wants them: while a scheduler, worker
or Nanny of dask-otel's runs in the process or a client it traces is open, and for good
once anyone else asked for a meter (whose instruments may record any time). Making the
reader only when a Dask role appears would not do: the provider and its readers must exist
from the start for a user's own instruments, and the thread must also stop when the last
server closes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader

from dask_otel import runtime
from dask_otel.export.abandon import abandonable, abandoned
from dask_otel.export.connections import close_inherited
from dask_otel.runtime import report_once, start_daemon
from dask_otel.runtime_state import Instances

logger = logging.getLogger(__name__)


#: Seconds between two looks for servers that stopped without closing and clients closed.
WATCH = 0.2


class OnDemandReader(PeriodicExportingMetricReader):
    """The SDK's periodic reader, its thread running only while metrics are wanted."""

    def __init__(
        self,
        exporter: Any,
        export_interval_millis: float | None = None,
        export_timeout_millis: float | None = None,
    ) -> None:
        super().__init__(exporter, math.inf, export_timeout_millis)  # no thread of its own
        #: Seconds between collections.
        self.interval = _export_interval(export_interval_millis) / 1000
        self._run_lock = threading.Lock()
        #: Set to stop the thread that ticks now (None: none does).
        self._ticking: threading.Event | None = None
        _readers.add(self)
        self.run(runtime.metric_demand.wanted())

    def run(self, wanted: bool) -> None:
        """Start or stop ticking."""
        with self._run_lock:
            if wanted and self._ticking is None and not self._shutdown:
                if self.interval < math.inf:
                    stop = threading.Event()
                    tick = functools.partial(self._tick, stop)
                    if start_daemon(logger, tick, "OtelPeriodicExportingMetricReader", "metrics"):
                        self._ticking = stop
            elif not wanted and self._ticking is not None:
                self._ticking.set()
                self._ticking = None

    def _gated_collect(self, timeout_millis: float) -> None:
        """Collect as work a fork waits for (``runtime.fork_gate``): the SDK holds its
        locks meanwhile."""
        with runtime.fork_gate.work():
            self.collect(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        with runtime.fork_gate.work():  # it collects (see _gated_collect)
            return super().force_flush(timeout_millis=timeout_millis)

    def _tick(self, stop: threading.Event) -> None:
        """Collect every ``interval``; in between, look every :data:`WATCH` seconds for
        servers that stopped without closing (the last one's going stops this thread)."""
        due = time.monotonic() + self.interval
        while not stop.wait(min(WATCH, max(0.0, due - time.monotonic()))):
            try:
                runtime.metric_demand.forget_stopped()
                if stop.is_set() or time.monotonic() < due:
                    continue
                due = time.monotonic() + self.interval
                self._gated_collect(self._export_timeout_millis)
            except Exception:
                report_once(logger, "metric collection", "dask-otel: collecting metrics failed")

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.run(False)
        if not self._shutdown and self.interval < math.inf:
            # The last collection, which the SDK's thread makes as it stops.
            with contextlib.suppress(Exception):
                self._gated_collect(timeout_millis)
        super().shutdown(timeout_millis=timeout_millis, **kwargs)

    def forget_parent(self) -> None:
        """In a forked child: the parent's thread is not here, nor are its connections."""
        self._run_lock = threading.Lock()
        self._ticking = None
        close_inherited(self._exporter)
        self.run(runtime.metric_demand.wanted())


def _export_interval(millis: float | None) -> float:
    """``millis``, else ``OTEL_METRIC_EXPORT_INTERVAL``, else 60 s, as the SDK reads it."""
    if millis is None:
        value = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")
        try:
            millis = float(value)
        except ValueError:
            report_once(
                logger,
                "OTEL_METRIC_EXPORT_INTERVAL",
                "dask-otel: OTEL_METRIC_EXPORT_INTERVAL must be a number, got %r; using 60000",
                value,
            )
            millis = 60000.0
    if millis <= 0:
        raise ValueError(f"OTEL_METRIC_EXPORT_INTERVAL must be positive, got {millis}")
    return millis


#: The metric readers' exporters of the meter provider dask-otel configured (in a forked
#: child, their readers' export locks come first: a reader's thread, started again, takes
#: them).
metric_exporters: Instances[_WatchedMetricExporter] = runtime.own(Instances())
#: The readers dask-otel configured in this process.
_readers: Instances[OnDemandReader] = runtime.own(Instances())


def _run_readers(wanted: bool) -> None:
    for reader in _readers:
        reader.run(wanted)


runtime.metric_demand.listen(_run_readers)


@contextlib.contextmanager
def readers_on_demand() -> Iterator[None]:
    """While the SDK's configurator runs, its periodic readers are :class:`OnDemandReader`
    s: it makes one per metric exporter and, unlike span and log record processors, takes
    no other kind. With an SDK laid out differently, its readers tick from the start."""
    from opentelemetry.sdk import _configuration

    if getattr(_configuration, "PeriodicExportingMetricReader", None) is not (
        PeriodicExportingMetricReader
    ):
        yield
        return
    _configuration.PeriodicExportingMetricReader = OnDemandReader  # type: ignore[misc]
    try:
        yield
    finally:
        _configuration.PeriodicExportingMetricReader = PeriodicExportingMetricReader  # type: ignore[misc]


def note_foreign_meters(provider: Any) -> None:
    """From the first meter anyone but dask-otel asks ``provider`` for, metrics are
    wanted for good (the SDK tells no one of a new meter: its method is wrapped here)."""
    get_meter = getattr(provider, "get_meter", None)
    if get_meter is None:
        return

    def noted(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != runtime.SCOPE:
            runtime.metric_demand.always()
        return get_meter(name, *args, **kwargs)

    provider.get_meter = noted
    # Meters asked for before the SDK was configured (the API's proxies, which
    # ``set_meter_provider`` resolved meanwhile) are there already.
    if any(scope.name != runtime.SCOPE for scope in list(getattr(provider, "_meters", ()))):
        runtime.metric_demand.always()


class _WatchedMetricExporter:
    """A metric reader's exporter whose exports ``runtime.health`` hears of (a Nanny's
    process exports metrics only), and which the exit stops as it stops the queues."""

    def __init__(self, exporter: Any, reader: Any) -> None:
        self._exporter = exporter
        #: The SDK's reader that calls :meth:`export` holding its export lock.
        self._reader = reader
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._exporter, name)

    def export(self, *args: Any, **kwargs: Any) -> Any:
        if self._stopped:  # the reader's last collection, after the exit stopped this
            return MetricExportResult.FAILURE
        with runtime.fork_gate.work(), runtime.health.exporting() as outcome:
            try:
                result = self._exporter.export(*args, **kwargs)
            except Exception:
                if abandoned():  # given up: its call was cut (a closed channel)
                    return MetricExportResult.FAILURE
                raise
            outcome.ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
            return result

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        if not self._stopped:
            self._stopped = True
            self._exporter.shutdown(*args, **kwargs)

    def stop(self) -> None:
        try:
            self.shutdown()
        except Exception:
            logger.debug("dask-otel: metric exporter shutdown failed", exc_info=True)

    def forget_parent(self) -> None:
        """In a forked child: the reader's export lock is free (its thread held it while
        the fork waited, see ``runtime.fork_gate``, and is not here)."""
        if hasattr(self._reader, "_export_lock"):
            self._reader._export_lock = threading.Lock()


def watch_metric_exporters(provider: Any) -> None:
    """Wrap the exporter of each of ``provider``'s periodic readers (the SDK offers no
    hook for it: with a reader laid out differently, its exports go unwatched)."""
    readers = getattr(provider, "_metric_readers", ())
    for reader in readers:
        exporter = getattr(reader, "_exporter", None)
        if exporter is not None and not isinstance(exporter, _WatchedMetricExporter):
            abandonable(exporter)
            reader._exporter = watched = _WatchedMetricExporter(exporter, reader)
            metric_exporters.add(watched)
