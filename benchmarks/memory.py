"""Scheduler memory dask-otel holds per in-flight task, and what it keeps afterwards.

1. In flight: N tasks wait on the scheduler (each depends on one task blocked on a
   ``distributed.Event``) on an in-process ``LocalCluster(n_workers=2,
   threads_per_worker=1, processes=False)``, plain and instrumented (every task traced:
   ``otel.task.max-spans-per-graph`` >= N). ``tracemalloc`` snapshots taken before the
   submission and while the tasks wait give, per task, the bytes still allocated from
   ``dask_otel`` source files, and the total bytes held (instrumented minus plain is
   everything dask-otel costs, allocations it causes inside Dask and the SDK included).
2. No leak: 10 computations one after another on one instrumented cluster, each
   released when done. After each: the scheduler plugin's task records, open graphs and
   pending events (its ``held()``), the span emitter's backlog, the entries of the bounded
   cache of parsed trace contexts (``dask_otel.spans.ids.DECODED_CARRIERS``, one per graph;
   emptied before measuring, so that the rest shows what it does not bound), the objects
   made by ``dask_otel`` code that are still alive (every object the garbage collector
   tracks whose allocation ``tracemalloc`` traces to a ``dask_otel`` file), and the bytes
   allocated from ``dask_otel`` files still alive, against the state after the first
   computation. The bytes also count memory that dask-otel allocated and freed and that
   CPython's free lists then gave to Dask, which keeps some state of every computation
   (about 1.4 MB per 2,000-task computation here, instrumented or not): ``tracemalloc``
   reports a reused block under its first allocation. The object count has no such
   blind spot (for tracked objects).

Spans go to the real SDK (the batch span processor dask-otel configures) and an exporter
that discards them.

    python benchmarks/memory.py --tasks 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Sequence

import dask
from distributed import Client, Event, LocalCluster, wait
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    LogRecordExporter,
    LogRecordExportResult,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

import dask_otel
from dask_otel.export import processors
from dask_otel.spans import emitter, ids

DASK_OTEL = tracemalloc.Filter(True, "*/dask_otel/*")


class DiscardingExporter(SpanExporter):
    def export(self, spans: Sequence) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class DiscardingLogExporter(LogRecordExporter):
    def export(self, batch: Sequence) -> LogRecordExportResult:
        return LogRecordExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def noop(i: int, gate: object = None) -> int:
    return i


def blocked(name: str) -> None:
    Event(name).wait()


def cluster() -> LocalCluster:
    return LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
    )


def traced_bytes(snapshot: tracemalloc.Snapshot, only_dask_otel: bool) -> int:
    if only_dask_otel:
        snapshot = snapshot.filter_traces([DASK_OTEL])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def objects_from_dask_otel() -> int:
    """Live objects (those the garbage collector tracks) allocated in ``dask_otel`` code."""
    return sum(
        1
        for obj in gc.get_objects()
        if (where := tracemalloc.get_object_traceback(obj)) is not None
        and "/dask_otel/" in where[0].filename
    )


def snapshot() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot()


def wait_until(predicate, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not get there in time")
        time.sleep(0.05)


def count_states(dask_scheduler) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for ts in dask_scheduler.tasks.values():
        counts[ts.state] = counts.get(ts.state, 0) + 1
    return counts


def plugin_state(scheduler) -> dict[str, int]:  # type: ignore[no-untyped-def]
    plugin = scheduler.plugins.get("dask-otel")
    if plugin is None:
        return {}
    held = plugin.held()
    running = plugin.settings is not None
    return {
        "records": held["records"],
        "graphs": held["graphs"],
        "backlog": emitter.shared().backlog if running else 0,
        "events": held["events"],
    }


def in_flight(tasks: int) -> dict[str, float]:
    """Bytes held while ``tasks`` tasks wait on the scheduler (total and dask_otel's)."""
    with cluster() as c, Client(c) as client:
        scheduler = c.scheduler
        client.gather(client.map(noop, range(100), pure=False))  # warm up
        wait_until(lambda: not scheduler.tasks)
        gate = client.submit(blocked, "gate", pure=False)
        wait_until(lambda: client.run_on_scheduler(count_states).get("processing") == 1)
        before = snapshot()
        futures = client.map(noop, range(tasks), gate=gate, pure=False)
        # Counted on the scheduler's event loop: once update_graph is over.
        wait_until(lambda: client.run_on_scheduler(count_states).get("waiting") == tasks)
        state = plugin_state(scheduler)
        during = snapshot()
        result = {
            "total": (traced_bytes(during, False) - traced_bytes(before, False)) / tasks,
            "dask_otel": (traced_bytes(during, True) - traced_bytes(before, True)) / tasks,
            "records": state.get("records", 0),
        }
        Event("gate", client=client).set()
        wait(futures)
        del futures, gate
    return result


def computations(count: int, tasks: int, provider: TracerProvider | None) -> list[dict[str, int]]:
    """dask-otel's state (``provider``: instrumented) and the bytes held after each of
    ``count`` computations."""
    rows = []
    with cluster() as c, Client(c) as client:
        scheduler = c.scheduler
        for i in range(count):
            futures = client.map(noop, range(tasks), pure=False)
            total = client.submit(sum, futures, pure=False)  # dependencies: transfers
            assert total.result() == tasks * (tasks - 1) // 2
            del futures, total
            wait_until(lambda: not scheduler.tasks)
            emitter.shared().flush(60)  # build what the scheduler and workers recorded
            row = plugin_state(scheduler)
            row["cache"] = ids.parsed_carriers(clear=True)
            if provider is not None:  # spans in the SDK's queue hold dask_otel's dicts
                provider.force_flush()
            snap = snapshot()
            row["total_bytes"] = traced_bytes(snap, False)
            if provider is not None:  # the plain rows are read for their total only
                row["dask_otel_bytes"] = traced_bytes(snap, True)
                row["dask_otel_objects"] = objects_from_dask_otel()
            row["computation"] = i + 1
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks in flight")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--computations", type=int, default=10)
    parser.add_argument("--computation-tasks", type=int, default=2_000)
    args = parser.parse_args()

    provider = TracerProvider()
    provider.add_span_processor(processors.span_processor(DiscardingExporter()))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(DiscardingLogExporter()))
    meter_provider = MeterProvider()
    instrumentor = dask_otel.DaskInstrumentor()
    dask.config.set(
        {
            "otel.task.max-spans-per-graph": max(args.tasks, args.computation_tasks) + 1,
            "distributed.diagnostics.nvml": False,
        }
    )
    tracemalloc.start()

    plain, traced = [], []
    for r in range(args.rounds):
        plain.append(in_flight(args.tasks))
        instrumentor.instrument(
            tracer_provider=provider, meter_provider=meter_provider, logger_provider=logger_provider
        )
        try:
            traced.append(in_flight(args.tasks))
        finally:
            instrumentor.uninstrument()
        provider.force_flush()
        print(
            f"round {r + 1}: plain {plain[-1]['total']:.0f} B/task, instrumented "
            f"{traced[-1]['total']:.0f} B/task (dask_otel files {traced[-1]['dask_otel']:.0f},"
            f" {traced[-1]['records']} records)",
            flush=True,
        )

    plain_rows = computations(args.computations, args.computation_tasks, None)
    instrumentor.instrument(
        tracer_provider=provider, meter_provider=meter_provider, logger_provider=logger_provider
    )
    try:
        rows = computations(args.computations, args.computation_tasks, provider)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
        logger_provider.shutdown()
        meter_provider.shutdown()
    tracemalloc.stop()

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):>7.0f} ({min(values):.0f}-{max(values):.0f})"

    extra = [t["total"] - p["total"] for p, t in zip(plain, traced, strict=True)]
    print(
        f"\nscheduler memory per in-flight task, {args.tasks} tasks waiting, "
        f"{args.rounds} rounds: median (min-max)"
    )
    print(f"  plain, total held                    {spread([p['total'] for p in plain])} B")
    print(f"  instrumented, total held             {spread([t['total'] for t in traced])} B")
    print(f"  dask-otel's cost (instr. - plain)    {spread(extra)} B")
    print(f"  of which allocated in dask_otel/     {spread([t['dask_otel'] for t in traced])} B")

    print(
        f"\n{args.computations} computations of {args.computation_tasks} tasks (+1 sum),"
        " each released before the next"
    )
    print(
        f"{'#':>3} {'records':>8} {'graphs':>7} {'backlog':>8} {'events':>7} {'cache':>6}"
        f" {'objects':>8} {'dask_otel B':>12} {'vs #1':>8} {'all B vs #1':>12}"
        f" {'plain: all B vs #1':>19}"
    )
    first, plain_first = rows[0], plain_rows[0]
    for row, plain_row in zip(rows, plain_rows, strict=True):
        print(
            f"{row['computation']:>3} {row['records']:>8} {row['graphs']:>7}"
            f" {row['backlog']:>8} {row['events']:>7} {row['cache']:>6}"
            f" {row['dask_otel_objects']:>8} {row['dask_otel_bytes']:>12}"
            f" {row['dask_otel_bytes'] - first['dask_otel_bytes']:>+8}"
            f" {row['total_bytes'] - first['total_bytes']:>+12}"
            f" {plain_row['total_bytes'] - plain_first['total_bytes']:>+19}"
        )
    last, plain_last = rows[-1], plain_rows[-1]
    growth = last["dask_otel_bytes"] - first["dask_otel_bytes"]
    instrumented = last["total_bytes"] - first["total_bytes"]
    plain_growth = plain_last["total_bytes"] - plain_first["total_bytes"]
    print(
        f"from computation 1 to {last['computation']}: objects made by dask_otel code"
        f" {last['dask_otel_objects'] - first['dask_otel_objects']:+d},"
        f" dask_otel allocations {growth:+d} B;"
        f" everything {instrumented:+d} B instrumented, {plain_growth:+d} B plain"
        " (the plain figure: Dask's own state)"
    )


if __name__ == "__main__":
    main()
