"""dask-otel's export queues: spans and log records queued for one daemon thread that
exports them in batches.

As the SDK's batch processors do, with three differences: the queue is bounded in
(estimated) bytes as well as in items, so that a collector that is down does not grow a
worker by tens of megabytes of unmanaged memory that Dask's spill and pause decisions
then act on; a flush waits no longer than its timeout and than the collector keeps
taking batches (runtime.health), instead of exporting the whole queue in the caller's
thread however long the exporter retries; and what is still queued when the process
exits is counted and said.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import (
    _SUPPRESS_INSTRUMENTATION_KEY,
    attach,
    detach,
    set_value,
)

from dask_otel import runtime
from dask_otel.export.connections import close_inherited
from dask_otel.export.drops import NOUNS, count_dropped, dropped, warn_dropped
from dask_otel.runtime import report_once, start_daemon
from dask_otel.runtime_state import Instances

logger = logging.getLogger(__name__)


#: Seconds between two looks at the collector's health while a flush waits.
LOOK = 0.05

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


@dataclass(frozen=True)
class QueueLimits:
    """How much an :class:`ExportQueue` holds, and how it batches."""

    max_items: int
    #: None: ``otel.max-queue-memory``, read once the process has imported Dask (a
    #: process that never does is not made to import it for one setting).
    max_bytes: int | None
    batch: int
    delay: float  #: seconds between scheduled exports


def queue_limits(signal: str, max_bytes: int | None, **options: Any) -> QueueLimits:
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


def _queue_memory() -> int | None:
    """``otel.max-queue-memory`` once Dask is imported, else None (its default applies
    meanwhile); its default if the settings cannot be read."""
    if "dask" not in sys.modules:
        return None
    settings = runtime.settings_if_dask_imported()
    return DEFAULT_QUEUE_MEMORY if settings is None else settings.max_queue_memory


#: ``otel.max-queue-memory``'s default, also in ``otel.yaml``.
DEFAULT_QUEUE_MEMORY = 16 * 2**20


class ExportQueue:
    """Spans or log records waiting for export, and the daemon thread that exports them.

    Bounded in items and in estimated bytes: an item that does not fit is dropped (and
    counted, ``queue_full``); the queue keeps the older ones. The thread exports a batch
    when one is full, every ``delay`` seconds while items wait, and at once for a
    :meth:`flush`. It runs only while items wait: started by the first one, it ends when
    the queue is empty. A process that never records runs no such thread, and one that
    stopped recording (a closed cluster) keeps none: distributed's tests count threads.
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
        #: The bound in bytes; None until ``otel.max-queue-memory`` can be read.
        self._max_bytes = limits.max_bytes
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
        #: When the export schedule last began (monotonic): at the queue's creation, and
        #: as each batch's export ends (see :meth:`next_export_due`).
        self.schedule_began = time.monotonic()
        #: Holds by Dask servers and clients taken before the queue began (see
        #: :meth:`_last_of_it`).
        self._holds_at_start = runtime.metric_demand.holds
        #: The exporting thread while items wait (see :meth:`_next_batch`).
        self._thread: threading.Thread | None = None
        runtime.health.watched = True
        export_queues.add(self)

    @property
    def max_bytes(self) -> int:
        """The bound in bytes (0: none)."""
        bound = self._max_bytes
        if bound is None:
            bound = self._max_bytes = _queue_memory()
        return DEFAULT_QUEUE_MEMORY if bound is None else bound

    def put(self, item: Any) -> bool:
        """Queue ``item`` unless it does not fit (counted as dropped); never blocks."""
        size = self._size(item)
        with self._lock:
            if self._closed:
                reason = "already_shutdown"
            elif (
                len(self._items) >= self.limits.max_items or 0 < self.max_bytes < self.bytes + size
            ):
                reason = "queue_full"
            else:
                self._items.append(item)
                self._sizes.append(size)
                self.bytes += size
                self._accepted += 1
                if len(self._items) >= self.limits.batch or self._last_of_it():
                    self._changed.notify()
                if self._thread is None:
                    self._start()
                return True
        count_dropped(self.signal, reason, 1)
        return False

    def __len__(self) -> int:
        """Items queued and not yet taken by an export."""
        return len(self._items)

    @contextlib.contextmanager
    def held_still(self) -> Iterator[list[Any]]:
        """The items queued, while no export is under way and none starts (for tests:
        what a process killed at this moment leaves in its queue)."""
        with self._lock:
            while self._in_flight:
                self._changed.wait()
            yield list(self._items)

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
        warn_dropped(self.signal)
        try:
            self.exporter.shutdown()
        except Exception:
            logger.debug("dask-otel: %s exporter shutdown failed", self.signal, exc_info=True)

    def _wait(self, target: int, timeout: float) -> bool:
        started = time.monotonic()
        deadline = started + timeout
        with self._lock:
            while self._done < target:
                patience = runtime.health.patience()  # as the exports go
                stop = min(deadline, runtime.health.give_up_at(started, patience))
                remaining = stop - time.monotonic()
                if remaining <= 0:
                    runtime.health.gave_up()
                    return False
                self._changed.wait(min(remaining, LOOK))
        return True

    def _start(self) -> None:
        """Start the exporting thread (the lock held, or not yet shared); if the
        interpreter cannot, say so once and keep the items for the next ``put`` to try
        again."""
        name = f"dask-otel-export-{self.signal}"
        self._thread = start_daemon(logger, self._run, name, f"exporting {NOUNS[self.signal]}")

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            with runtime.fork_gate.work():
                self._export(batch)

    def _next_batch(self) -> list[Any] | None:
        """Wait until a batch is due (full, flushed, scheduled, closing, or the last of it)
        and take it; None once the queue is empty (the thread ends; the next item starts
        another), or stopped."""
        limits = self.limits
        with self._lock:
            due = self.next_export_due()
            while not self._stopped and self._items:
                if self._last_of_it():  # at once
                    due = min(due, time.monotonic())
                items = len(self._items)
                if items >= limits.batch or (
                    self._closed or self._wanted > self._done or time.monotonic() >= due
                ):
                    count = min(limits.batch, items)
                    batch = [self._items.popleft() for _ in range(count)]
                    self.bytes -= sum(self._sizes.popleft() for _ in range(count))
                    self._in_flight = count
                    return batch
                self._changed.wait(max(0.0, due - time.monotonic()))
            self._thread = None
            return None

    def _last_of_it(self) -> bool:
        """Whether the Dask servers and traced clients open in this process since the queue
        began have all closed, moments ago: what comes now goes out at once, and the thread
        ends (a closed cluster leaves no thread waiting for the schedule)."""
        return runtime.metric_demand.all_closed_since(self._holds_at_start)

    def next_export_due(self, now: float | None = None) -> float:
        """When the next scheduled batch is due (monotonic) as of ``now`` (default: now):
        every ``delay`` seconds since :attr:`schedule_began`, as if a thread had waited all
        along (as the SDK's does): an item goes out when it would have then, not a whole
        ``delay`` after it came (a short script learns as early that its collector is down,
        and its exit waits no longer)."""
        if now is None:
            now = time.monotonic()
        delay = self.limits.delay
        ticks = max(1, math.ceil((now - self.schedule_began) / delay))
        return self.schedule_began + ticks * delay

    def _export(self, batch: list[Any]) -> None:
        warn_dropped(self.signal)  # queue drops since the last batch
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        lost = len(batch)
        try:
            with runtime.health.exporting() as outcome:
                self.exporter.export(batch)
                lost = self.exporter.lost
                outcome.ok = lost < len(batch)  # the collector took some
        except Exception:
            report_once(
                logger,
                f"export raised {self.signal}",
                "dask-otel: exporting %s raised; the batch is lost (said once)",
                NOUNS[self.signal],
            )
        finally:
            detach(token)
        with self._lock:  # counted and no longer in flight at once (see _say_loss)
            if lost:
                count_dropped(self.signal, "export_failed", lost)
            self._done += len(batch)
            self._in_flight = 0
            self.schedule_began = time.monotonic()
            self._changed.notify_all()
        if lost:
            warn_dropped(self.signal)

    def forget_parent(self) -> None:
        """In a forked child: what the parent queued is the parent's to export, and the
        parent's thread is not here."""
        self._items.clear()
        self._sizes.clear()
        self.bytes = self._in_flight = 0
        self._accepted = self._done = self._wanted = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = None  # the next item starts one
        self._holds_at_start = runtime.metric_demand.holds
        close_inherited(self.exporter)


#: Every export queue of this process: forgotten after fork, counted at exit.
export_queues: Instances[ExportQueue] = runtime.own(Instances())


def unexported() -> tuple[Counter[str], dict[tuple[str, str], int]]:
    """What this process has not exported, read at one instant (no batch moves from in
    flight to lost meanwhile): spans and log records still queued or in an export under
    way, by signal; and those lost, by (signal, reason)."""
    held: Counter[str] = Counter()
    with contextlib.ExitStack() as locks:
        for queue in export_queues:
            locks.enter_context(queue._lock)
            held[queue.signal] += len(queue._items) + queue._in_flight
        return held, dropped()


def _wake_queues(_: bool) -> None:
    """A server or client began or stopped holding the metric demand: the exporting threads
    look again when a batch is due (see :meth:`ExportQueue._next_batch`)."""
    for queue in export_queues:
        with queue._changed:
            queue._changed.notify_all()


runtime.metric_demand.listen(_wake_queues)
