"""The catalog of every instrument dask-otel creates: pure data.

README, the Grafana dashboard and the tests are checked against :data:`INSTRUMENTS`; the
SDK setup (:mod:`dask_otel.distro`) reads the drop counter's entry from here without
touching Dask.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instrument:
    kind: str  # "counter" (observable, monotonic), "gauge" (observable) or "histogram"
    unit: str
    description: str
    attributes: tuple[str, ...] = ()


#: Every instrument dask-otel creates: name -> kind, UCUM unit, description and the
#: attributes its points carry besides ``dask.cluster.id`` (and, on worker metrics,
#: ``dask.worker.address`` and ``dask.worker.name``).
INSTRUMENTS: dict[str, Instrument] = {
    # -- scheduler -----------------------------------------------------------------------
    "dask.scheduler.clients": Instrument("gauge", "{client}", "Clients connected"),
    "dask.scheduler.client.connections": Instrument(
        "counter", "{connection}", "Client connections added and removed", ("dask.change",)
    ),
    "dask.scheduler.workers": Instrument(
        "gauge", "{worker}", "Workers by state", ("dask.worker.state",)
    ),
    "dask.scheduler.worker.changes": Instrument(
        "counter", "{worker}", "Workers added and removed", ("dask.change",)
    ),
    "dask.scheduler.workers.desired": Instrument(
        "gauge", "{worker}", "Workers the scheduler wants for its current load (adaptive)"
    ),
    "dask.scheduler.tasks": Instrument(
        "gauge", "{task}", "Tasks known to the scheduler by state", ("dask.task.state",)
    ),
    "dask.scheduler.tasks.forgotten": Instrument(
        "counter", "{task}", "Tasks processed and forgotten"
    ),
    "dask.scheduler.tasks.suspicious": Instrument(
        "counter", "{task}", "Times a task was on a worker that died", ("dask.task.prefix",)
    ),
    "dask.scheduler.task_groups": Instrument("gauge", "{group}", "Task groups known"),
    "dask.scheduler.event_loop.ticks": Instrument("counter", "{tick}", "Event-loop ticks"),
    "dask.scheduler.event_loop.tick.max_duration": Instrument(
        "gauge", "s", "Longest event-loop tick since the previous collection"
    ),
    "dask.scheduler.gc.time": Instrument("counter", "s", "Time spent in garbage collection"),
    "dask.scheduler.gil.contention": Instrument(
        "counter", "s", "GIL contention (only when Dask monitors it, with gilknocker)"
    ),
    "dask.scheduler.stealing.requests": Instrument(
        "counter", "{request}", "Work-stealing requests", ("dask.stealing.cost_multiplier",)
    ),
    "dask.scheduler.stealing.cost": Instrument(
        "counter", "1", "Cost of work-stealing requests", ("dask.stealing.cost_multiplier",)
    ),
    "dask.scheduler.semaphore.leases.max": Instrument(
        "gauge", "{lease}", "Leases a semaphore allows", ("dask.semaphore.name",)
    ),
    "dask.scheduler.semaphore.leases.active": Instrument(
        "gauge", "{lease}", "Leases held", ("dask.semaphore.name",)
    ),
    "dask.scheduler.semaphore.leases.pending": Instrument(
        "gauge", "{lease}", "Leases waited for", ("dask.semaphore.name",)
    ),
    "dask.scheduler.semaphore.acquired": Instrument(
        "counter", "{lease}", "Leases acquired", ("dask.semaphore.name",)
    ),
    "dask.scheduler.semaphore.released": Instrument(
        "counter", "{lease}", "Leases released", ("dask.semaphore.name",)
    ),
    "dask.scheduler.semaphore.pending_time": Instrument(
        "gauge", "s", "Moving average of the wait for a lease", ("dask.semaphore.name",)
    ),
    "dask.task.compute.time": Instrument(
        "counter", "s", "Compute time of finished tasks", ("dask.task.prefix",)
    ),
    "dask.task.transfer.time": Instrument(
        "counter", "s", "Time spent moving tasks' inputs between workers", ("dask.task.prefix",)
    ),
    "dask.task.output.size": Instrument(
        "gauge", "By", "Bytes of task results in memory (no duplicates)", ("dask.task.prefix",)
    ),
    "dask.task.finished": Instrument(
        "counter",
        "{task}",
        "Tasks that reached a final state",
        ("dask.task.prefix", "dask.task.state"),
    ),
    # -- worker ------------------------------------------------------------------------
    "dask.worker.tasks": Instrument(
        "gauge", "{task}", "Tasks on the worker by state", ("dask.task.state",)
    ),
    "dask.worker.threads": Instrument("gauge", "{thread}", "Threads running tasks"),
    "dask.worker.latency": Instrument("gauge", "s", "Heartbeat round trip to the scheduler"),
    "dask.worker.memory": Instrument(
        "gauge", "By", "Worker memory: managed, unmanaged, spilled", ("dask.memory.type",)
    ),
    "dask.worker.transfer.active.size": Instrument(
        "gauge", "By", "Bytes of open transfers", ("dask.transfer.direction",)
    ),
    "dask.worker.transfer.active.count": Instrument(
        "gauge", "{transfer}", "Open transfers", ("dask.transfer.direction",)
    ),
    "dask.worker.transfer.count": Instrument(
        "counter", "{transfer}", "Transfers since the worker started", ("dask.transfer.direction",)
    ),
    "dask.worker.transfer.size": Instrument(
        "counter", "By", "Bytes sent to other workers", ("dask.transfer.direction",)
    ),
    "dask.worker.spill.size": Instrument(
        "counter", "By", "Bytes moved by spilling and unspilling", ("dask.spill.activity",)
    ),
    "dask.worker.spill.count": Instrument(
        "counter",
        "{key}",
        "Reads and writes of managed data: memory reads, disk writes and reads",
        ("dask.spill.activity",),
    ),
    "dask.worker.spill.time": Instrument(
        "counter", "s", "Time spent spilling and unspilling", ("dask.spill.activity",)
    ),
    "dask.worker.event_loop.ticks": Instrument("counter", "{tick}", "Event-loop ticks"),
    "dask.worker.event_loop.tick.max_duration": Instrument(
        "gauge", "s", "Longest event-loop tick since the previous collection"
    ),
    "dask.worker.gc.time": Instrument("counter", "s", "Time spent in garbage collection"),
    "dask.worker.gil.contention": Instrument(
        "counter", "s", "GIL contention (only when Dask monitors it, with gilknocker)"
    ),
    "dask.worker.activity.time": Instrument(
        "counter",
        "s",
        "Dask's fine performance metrics: time by context and activity",
        ("dask.metric.context", "dask.task.prefix", "dask.activity"),
    ),
    "dask.worker.activity.size": Instrument(
        "counter",
        "By",
        "Dask's fine performance metrics: bytes by context and activity",
        ("dask.metric.context", "dask.task.prefix", "dask.activity"),
    ),
    "dask.worker.transfer.duration": Instrument(
        "histogram",
        "s",
        "Duration of one dependency fetch from a peer (gather_dep)",
        ("dask.transfer.outcome",),
    ),
    "dask.worker.transfer.received": Instrument(
        "histogram",
        "By",
        "Bytes of one successful dependency fetch (sizes as the scheduler estimates them)",
        ("dask.transfer.outcome",),
    ),
    "dask.task.duration": Instrument(
        "histogram",
        "s",
        "Run time of one task attempt on a worker",
        ("dask.task.prefix", "dask.task.outcome"),
    ),
    "dask.nanny.worker.memory": Instrument(
        "histogram",
        "By",
        "Resident memory of the worker process, read by its Nanny at each memory monitor "
        "interval (the max of a point is the peak since the last export)",
        ("dask.nanny.address",),
    ),
    # -- dask-otel itself (reported by dask_otel.distro.sdk, where dask-otel configured the SDK) -
    "dask_otel.exporter.dropped": Instrument(
        "counter",
        "{item}",
        "Spans and log records lost by this process's exporters (full queue, failed export) "
        "and, counted by its Nanny, those a dead worker's flight recorder did not hold",
        ("dask_otel.signal", "error.type"),
    ),
}

#: Counted by :mod:`dask_otel.distro.sdk` (no Dask state to read): not one of :class:`Sources`'.
DROPPED = "dask_otel.exporter.dropped"

#: Bucket boundaries (seconds) for task and transfer durations: 1 ms to 1 h.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
#: Bucket boundaries (bytes) for transfer sizes: 1 kB to 10 GB.
SIZE_BUCKETS = tuple(10.0**e for e in range(3, 11))
#: Bucket boundaries (bytes) for a process's memory: 64 MiB to 1 TiB, doubling.
MEMORY_BUCKETS = tuple(float(2**e) for e in range(26, 41))
