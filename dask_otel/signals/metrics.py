"""Dask's metrics as OpenTelemetry instruments, read in observable callbacks.

Everything Dask's Prometheus collectors expose (and its fine performance metrics) is read
on the SDK's metric thread, when a reader collects: nothing is added to the scheduler's
or the worker's hot path. Callbacks take atomic snapshots (``list(d.items())``,
``dict(d)``: single C calls under the GIL) of Dask's live dicts before looping over them;
the one Dask call that loops over live sets itself (``adaptive_target``) is guarded.
The histograms recorded per event (``dask.task.duration`` per attempt, the transfer
duration and bytes per fetch) are recorded by the span emitter's thread, off the event
loop. ``dask.task.prefix`` is the only task-derived attribute.

:data:`INSTRUMENTS` is the catalog (README and the Grafana dashboard are checked against
it); each meter provider gets one set of instruments, fed by every scheduler and worker
registered with it in this process.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from time import time
from typing import TYPE_CHECKING, Any, get_args

from distributed.core import Status
from distributed.scheduler import ALL_TASK_STATES
from distributed.worker_state_machine import TaskStateState
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from dask_otel import runtime, strings
from dask_otel.runtime import SCOPE, metric_demand, report_once
from dask_otel.runtime_state import ProcessState
from dask_otel.signals.instruments import (
    DROPPED,
    DURATION_BUCKETS,
    INSTRUMENTS,
    MEMORY_BUCKETS,
    SIZE_BUCKETS,
)
from dask_otel.version import __version__

if TYPE_CHECKING:
    from dask_otel.config import Settings
    from dask_otel.runtime import Providers

Attributes = dict[str, Any]
logger = logging.getLogger(__name__)

#: Worker task states reported even when no task is in them (and "disk", spilled memory).
WORKER_TASK_STATES = (
    *get_args(TaskStateState),
    "disk",
)
#: Scheduler task states reported even when no task is in them, as Dask's Prometheus
#: collector does: a series that vanishes at zero reads as "no data", not as none.
SCHEDULER_TASK_STATES = tuple(sorted(ALL_TASK_STATES - {"forgotten"}))


Points = Iterator[tuple[str, float, Attributes]]
Observer = Callable[[Any, Attributes], Points]


def _tick_max(server: Any) -> float:
    """Longest tick since the last read (as Dask's Prometheus collectors report it)."""
    longest = server.digests_max.pop("tick-duration", 0)
    return max(longest, time() - server._last_tick)


#: Longest label taken from a name the user chose (a key's prefix, a semaphore's name,
#: a metered activity): ``otel.max-attribute-length``'s default.
LABEL_LENGTH = 256


def _label(name: Any) -> str:
    """A user-chosen name as a label: capped, and valid UTF-8 (see :func:`strings.cap`)."""
    return strings.cap(str(name), LABEL_LENGTH)


def _observe_scheduler(s: Any, base: Attributes) -> Iterator[tuple[str, float, Attributes]]:
    yield (
        "dask.scheduler.clients",
        len([c for c in list(s.clients) if c != "fire-and-forget"]),
        base,
    )
    conn = "dask.scheduler.client.connections"
    yield conn, s._client_connections_added_total, {**base, "dask.change": "added"}
    yield conn, s._client_connections_removed_total, {**base, "dask.change": "removed"}
    workers = list(s.workers.values())
    paused = sum(1 for ws in workers if ws.status.name == "paused")
    running, idle, saturated = len(s.running), len(s.idle), len(s.saturated)
    by_state = {
        "idle": idle,
        "partially_saturated": running - idle - saturated,
        "saturated": saturated,
        "paused": paused,
        "retiring": len(workers) - paused - running,
    }
    for state, count in by_state.items():
        yield "dask.scheduler.workers", count, {**base, "dask.worker.state": state}
    changes = "dask.scheduler.worker.changes"
    yield changes, s._workers_added_total, {**base, "dask.change": "added"}
    yield changes, s._workers_removed_total, {**base, "dask.change": "removed"}
    try:  # loops over live scheduler sets: may race with the event loop
        desired = s.adaptive_target()
    except RuntimeError:
        desired = None
    if desired is not None:
        yield "dask.scheduler.workers.desired", desired, base
    yield "dask.scheduler.task_groups", len(s.task_groups), base
    totals: dict[str, int] = {}
    forgotten = 0
    for tp in list(s.task_prefixes.values()):
        prefix = {**base, "dask.task.prefix": _label(tp.name)}
        for state, count in dict(tp.states).items():
            totals[state] = totals.get(state, 0) + count
        yield "dask.scheduler.tasks.suspicious", tp.suspicious, prefix
        durations = dict(tp._all_durations_us)
        yield "dask.task.compute.time", durations.get("compute", 0) / 1e6, prefix
        yield "dask.task.transfer.time", durations.get("transfer", 0) / 1e6, prefix
        yield "dask.task.output.size", tp.nbytes_total, prefix
        counts = dict(tp.state_counts)
        forgotten += counts.get("forgotten", 0)  # grows only, unlike tp.states
        for state in ("memory", "erred"):
            yield "dask.task.finished", counts.get(state, 0), {**prefix, "dask.task.state": state}
    yield "dask.scheduler.tasks.forgotten", forgotten, base
    for state in SCHEDULER_TASK_STATES:
        yield "dask.scheduler.tasks", totals.get(state, 0), {**base, "dask.task.state": state}
    yield from _observe_extensions(dict(s.extensions), base)
    yield from _observe_server(s, "dask.scheduler", base)


def _observe_extensions(extensions: dict[str, Any], base: Attributes) -> Points:
    """Work stealing and semaphores, as Dask's extension collectors report them."""
    stealing = extensions.get("stealing")
    if stealing is not None:
        counts = dict(stealing.metrics["request_count_total"])
        costs = dict(stealing.metrics["request_cost_total"])
        for level, multiplier in enumerate(stealing.cost_multipliers):
            attributes = {**base, "dask.stealing.cost_multiplier": multiplier}
            yield "dask.scheduler.stealing.requests", counts.get(level, 0), attributes
            yield "dask.scheduler.stealing.cost", costs.get(level, 0), attributes
    semaphores = extensions.get("semaphores")
    if semaphores is not None:
        metrics_by_kind = {kind: dict(values) for kind, values in semaphores.metrics.items()}
        for name, max_leases in list(semaphores.max_leases.items()):
            attributes = {**base, "dask.semaphore.name": _label(name)}
            ns = "dask.scheduler.semaphore"
            yield f"{ns}.leases.max", max_leases, attributes
            yield f"{ns}.leases.active", len(semaphores.leases.get(name, ())), attributes
            yield f"{ns}.leases.pending", metrics_by_kind["pending"].get(name, 0), attributes
            yield f"{ns}.acquired", metrics_by_kind["acquire_total"].get(name, 0), attributes
            yield f"{ns}.released", metrics_by_kind["release_total"].get(name, 0), attributes
            pending_time = metrics_by_kind["average_pending_lease_time"].get(name, 0)
            yield f"{ns}.pending_time", pending_time, attributes


def _observe_server(
    server: Any, ns: str, base: Attributes
) -> Iterator[tuple[str, float, Attributes]]:
    """What schedulers and workers both have: event loop and garbage collection."""
    from distributed.gc import gc_collect_duration

    yield f"{ns}.event_loop.ticks", server._tick_counter, base
    yield f"{ns}.event_loop.tick.max_duration", _tick_max(server), base
    yield f"{ns}.gc.time", gc_collect_duration(), base
    if server.monitor.monitor_gil_contention:
        yield f"{ns}.gil.contention", server.monitor.cumulative_gil_contention, base


def _fine_performance_metrics(
    digests: dict[Any, float], base: Attributes
) -> Iterator[tuple[str, float, Attributes]]:
    """Dask's per-activity timings: keys (context, [span id,] [prefix,] activity, unit).

    Dask's span ids are dropped (unbounded); values that differ only by them are summed.
    """
    names = {"seconds": "time", "bytes": "size"}
    totals: dict[tuple[str, str, str | None, str], float] = {}
    for key, value in list(digests.items()):
        if not isinstance(key, tuple) or len(key) < 3 or key[-1] not in names:
            continue
        # P2P keys are (p2p, span id, where, activity, unit): no task prefix there.
        prefix = _label(key[-3]) if len(key) >= 4 and key[0] != "p2p" else None
        group = (names[key[-1]], _label(key[0]), prefix, _label(key[-2]))
        totals[group] = totals.get(group, 0.0) + value
    for (name, context, prefix, activity), value in totals.items():
        attributes = {**base, "dask.metric.context": context, "dask.activity": activity}
        if prefix is not None:
            attributes["dask.task.prefix"] = prefix
        yield f"dask.worker.activity.{name}", value, attributes


def _observe_worker(w: Any, base: Attributes) -> Iterator[tuple[str, float, Attributes]]:
    state = w.state
    counts = dict.fromkeys(WORKER_TASK_STATES, 0)  # report 0, not silence, for idle states
    for (_, task_state), count in list(state.task_counter._current_count.items()):
        counts[task_state] = counts.get(task_state, 0) + count
    slow = getattr(w.data, "slow", None)
    if slow is not None:
        spilled = len(slow)
        counts["memory"] -= spilled
        counts["disk"] = spilled
    for task_state, count in counts.items():
        yield "dask.worker.tasks", count, {**base, "dask.task.state": task_state}
    yield "dask.worker.threads", state.nthreads, base
    yield "dask.worker.latency", w.latency, base
    spilled_memory, spilled_disk = getattr(w.data, "spilled_total", (0, 0))
    process = w.monitor.get_process_memory()
    managed = min(process, state.nbytes - spilled_memory)
    memory = {"managed": managed, "unmanaged": process - managed, "spilled": spilled_disk}
    for kind, value in memory.items():
        yield "dask.worker.memory", value, {**base, "dask.memory.type": kind}
    incoming = {**base, "dask.transfer.direction": "incoming"}
    outgoing = {**base, "dask.transfer.direction": "outgoing"}
    yield "dask.worker.transfer.active.size", state.transfer_incoming_bytes, incoming
    yield "dask.worker.transfer.active.size", w.transfer_outgoing_bytes, outgoing
    yield "dask.worker.transfer.active.count", state.transfer_incoming_count, incoming
    yield "dask.worker.transfer.active.count", w.transfer_outgoing_count, outgoing
    yield "dask.worker.transfer.count", state.transfer_incoming_count_total, incoming
    yield "dask.worker.transfer.count", w.transfer_outgoing_count_total, outgoing
    yield "dask.worker.transfer.size", w.transfer_outgoing_bytes_total, outgoing
    spill_names = {"bytes": "size", "count": "count", "seconds": "time"}
    for (activity, unit), value in list(getattr(w.data, "cumulative_metrics", {}).items()):
        name = spill_names.get(unit)
        if name:
            yield f"dask.worker.spill.{name}", value, {**base, "dask.spill.activity": activity}
    yield from _fine_performance_metrics(w.digests_total, base)
    yield from _observe_server(w, "dask.worker", base)


def _histogram(meter: metrics.Meter, name: str, buckets: tuple[float, ...]) -> metrics.Histogram:
    spec = INSTRUMENTS[name]
    return meter.create_histogram(
        name,
        unit=spec.unit,
        description=spec.description,
        explicit_bucket_boundaries_advisory=list(buckets),
    )


class Sources:
    """The servers feeding one meter provider's instruments, read on the metric thread."""

    def __init__(self, meter: metrics.Meter) -> None:
        self._lock = threading.Lock()
        self._servers: dict[int, tuple[Any, Observer, Attributes]] = {}
        self._cache: dict[str, list[Observation]] = {}
        self._generation = -1
        for name, spec in INSTRUMENTS.items():
            if spec.kind == "histogram" or name == DROPPED:
                continue
            create = (
                meter.create_observable_counter
                if spec.kind == "counter"
                else meter.create_observable_gauge
            )
            create(
                name, callbacks=[self._callback(name)], unit=spec.unit, description=spec.description
            )
        self.task_duration = _histogram(meter, "dask.task.duration", DURATION_BUCKETS)
        self.transfer_duration = _histogram(
            meter, "dask.worker.transfer.duration", DURATION_BUCKETS
        )
        self.transfer_received = _histogram(meter, "dask.worker.transfer.received", SIZE_BUCKETS)
        self.worker_memory = _histogram(meter, "dask.nanny.worker.memory", MEMORY_BUCKETS)

    def forget_parent(self) -> None:
        """In a forked child: none of the parent's servers runs here."""
        self._lock = threading.Lock()
        self._servers.clear()
        self._generation = -1

    def add(self, server: Any, observe: Observer, attributes: Attributes) -> None:
        with self._lock:
            self._servers[id(server)] = (weakref.proxy(server), observe, attributes)
            self._generation = -1
        metric_demand.hold(server, server_running)  # the metric thread reads it from now on

    def remove(self, server: Any) -> None:
        with self._lock:
            self._servers.pop(id(server), None)
            self._generation = -1
        metric_demand.release(server)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return self._observations().get(name, [])

        return callback

    def _observations(self) -> dict[str, list[Observation]]:
        """All points of one collection, read once: the first callback reads every server."""
        # One collection calls every callback in turn within a few milliseconds;
        # reading the servers once per 0.5 s serves all of them.
        now = int(time() * 2)
        with self._lock:
            if now == self._generation:
                return self._cache
            servers = list(self._servers.values())
        points: dict[str, list[Observation]] = {}
        for server, observe, attributes in servers:
            try:
                for name, value, attrs in observe(server, attributes):
                    points.setdefault(name, []).append(Observation(value, attrs))
            except ReferenceError:
                continue  # closed while we read it
            except Exception:
                report_once(
                    logger, "metrics", "dask-otel: reading Dask's metrics failed (said once)"
                )
        with self._lock:
            self._cache, self._generation = points, now
        return points


class AllSources(ProcessState):
    """The :class:`Sources` of each meter provider in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: By meter provider, kept no longer than the provider.
        self._by_provider: weakref.WeakKeyDictionary[Any, Sources] = weakref.WeakKeyDictionary()

    def of(self, meter_provider: metrics.MeterProvider) -> Sources:
        with self._lock:
            found = self._by_provider.get(meter_provider)
            if found is None:
                found = Sources(meter_provider.get_meter(SCOPE, __version__))
                self._by_provider[meter_provider] = found
            return found

    def all(self) -> list[Sources]:
        with self._lock:
            return list(self._by_provider.values())

    def forget_parent(self) -> None:
        """A forked child (a Nanny's worker, with ``fork``) runs none of its parent's
        servers: it must not report a frozen copy of the parent's scheduler or workers."""
        self._lock = threading.Lock()
        for found in self.all():
            found.forget_parent()


#: The one per process.
all_sources = runtime.own(AllSources())

_disabled = metrics.NoOpMeterProvider()


def meter_provider(providers: Providers, settings: Settings) -> metrics.MeterProvider:
    """Where a component's metrics go: nowhere when ``otel.metrics.enabled`` is false."""
    return providers.meter_provider if settings.metrics_enabled else _disabled


def sources(meter_provider: metrics.MeterProvider) -> Sources:
    """The instruments of ``meter_provider`` (created on first use)."""
    return all_sources.of(meter_provider)


def observe_scheduler(meter_provider: metrics.MeterProvider, scheduler: Any) -> None:
    sources(meter_provider).add(scheduler, _observe_scheduler, {"dask.cluster.id": scheduler.id})


def observe_worker(
    meter_provider: metrics.MeterProvider, worker: Any, attributes: Attributes
) -> None:
    """Report ``worker``'s metrics with ``attributes`` (a dict the caller may fill later)."""
    sources(meter_provider).add(worker, _observe_worker, attributes)


def server_running(server: Any) -> bool:
    """Whether a Dask server may still run: not once closed or failed, nor once its event
    loop is closed (a server stopped without closing, then left by the program that ran
    it: a test, say)."""
    if getattr(server, "status", None) in (Status.closed, Status.failed):
        return False
    loop = getattr(getattr(server, "loop", None), "asyncio_loop", None)
    return loop is None or not loop.is_closed()


def forget(meter_provider: metrics.MeterProvider, server: Any) -> None:
    sources(meter_provider).remove(server)


def observed() -> list[str]:
    """What this process reports metrics of: ``scheduler`` or ``worker``, per server."""
    roles = {_observe_scheduler: "scheduler", _observe_worker: "worker"}
    observers = []
    for source in all_sources.all():
        with source._lock:
            observers += [roles[observe] for _, observe, _ in source._servers.values()]
    return observers
