"""Assertions on received spans that several end-to-end tests share."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

#: The functions tests/scripts/workload.py submits, one computation each.
FUNCTIONS = ("slow_inc", "log_marker", "fail")


def by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def orphans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spans whose parent is not among the spans of their trace."""
    ids = {(s["trace_id"], s["span_id"]) for s in spans}
    return [
        s for s in spans if s["parent_span_id"] and (s["trace_id"], s["parent_span_id"]) not in ids
    ]


def duplicates(spans: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(trace id, span id) pairs that more than one span uses."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for s in spans:
        seen[s["trace_id"], s["span_id"]] += 1
    return [pair for pair, n in seen.items() if n > 1]


def trace_of(spans: list[dict[str, Any]], name: str, also: str) -> list[dict[str, Any]]:
    """All spans of the one trace that holds spans called ``name`` and ``also``."""
    traces = by_trace(spans).values()
    (trace,) = [t for t in traces if {name, also} <= {s["name"] for s in t}]
    return trace


def services(spans: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(service.name, service.instance.id) of every process that sent these spans."""
    return {
        (s["resource"].get("service.name"), s["resource"].get("service.instance.id")) for s in spans
    }


def check_workload_telemetry(
    rx: Any,
    observed: dict[str, Any],
    roles: set[str] = frozenset({"dask-client", "dask-scheduler", "dask-worker"}),
    client_traced: bool = True,
) -> None:
    """The contract every activation path must meet for tests/scripts/workload.py."""
    assert observed["results"] == list(range(1, 9))
    assert observed["failed"] == "injected failure 1"

    # One trace for the map: client, scheduler and both workers, no missing parent.
    # Every process exports on its own schedule: wait for all the spans the workload makes.
    # The scheduler names a graph span that roots its trace after what ran.
    graphs = {"graph": 3} if client_traced else {f"graph {f}": 1 for f in FUNCTIONS}
    expected = {
        "compute slow_inc": 1 if client_traced else 0,
        **graphs,
        "task slow_inc": 8,
        "task log_marker": 1,
        "task fail": 1,
        "attempt fail": 2,
    }
    rx.wait_for(lambda r: all(len(r.spans(name=n)) >= k for n, k in expected.items()))
    spans = rx.spans()
    graph = "graph" if client_traced else "graph slow_inc"
    mapped = trace_of(spans, graph, "task slow_inc")
    names = sorted({s["name"] for s in mapped} - {"transfer"})
    expected = [graph, "task slow_inc"]
    assert names == (["compute slow_inc", *expected] if client_traced else expected), names
    assert not orphans(mapped) and not duplicates(mapped)
    assert {name for name, _ in services(mapped)} == set(roles)
    tasks = [s for s in mapped if s["name"] == "task slow_inc"]
    # Each task's span comes from the worker that computed it.
    workers = {s["resource"]["service.instance.id"] for s in tasks}
    assert len(workers) == 2
    assert {s["resource"]["service.name"] for s in tasks} <= roles - {"dask-scheduler"}
    cluster_ids = {s["attributes"].get("dask.cluster.id") for s in mapped}
    assert len(cluster_ids) == 1 and next(iter(cluster_ids)).startswith("Scheduler-")
    for task in tasks:
        assert task["attributes"]["dask.task.nbytes"] > 0
        assert task["attributes"]["dask.worker.address"]

    # retries=1: two failed attempts on workers, one ERROR task span on the scheduler.
    failed = trace_of(spans, "task fail", "task fail")
    attempts = [s for s in failed if s["name"] == "attempt fail"]
    assert len(attempts) == 2 and all(s["status_code"] == 2 for s in attempts)
    for attempt in attempts:
        (exc,) = [e for e in attempt["events"] if e["name"] == "exception"]
        assert exc["attributes"]["exception.type"] == "ValueError"
    (task,) = [s for s in failed if s["name"] == "task fail"]
    assert task["status_code"] == 2 and task["attributes"]["dask.task.attempts"] == 2
    assert task["resource"]["service.name"] in roles - {"dask-worker"}  # the scheduler's
    (exc,) = [e for e in task["events"] if e["name"] == "exception"]
    assert exc["attributes"]["exception.type"] == "ValueError"
    assert not orphans(failed) and not duplicates(failed)

    # A log record written inside a task carries that task's span.
    records = rx.wait_for(
        lambda r: [x for x in r.log_records() if "marker-from-task 7" in str(x["body"])]
    )
    (marked,) = rx.spans(name="task log_marker")
    assert records[0]["span_id"] == marked["span_id"]
    assert records[0]["trace_id"] == marked["trace_id"]

    # The worker's metric pipeline works: a counter recorded inside a task arrives.
    points = rx.wait_for(lambda r: r.metrics(name="user.marker"))
    assert points[-1]["value"] == 7
    assert points[-1]["resource"]["service.name"] in roles

    # Dask's own records (its loggers may not propagate to the root) are exported too,
    # "Compute Failed" in the trace of the failed attempt, with the exception described.
    def compute_failed(r):
        records = [x for x in r.log_records() if str(x["body"]).startswith("Compute Failed")]
        return len(records) >= 2 and records  # the two attempts export independently

    failed_records = rx.wait_for(compute_failed)
    assert len(failed_records) == 2  # one per attempt, none twice
    assert {x["span_id"] for x in failed_records} == {s["span_id"] for s in attempts}
    for record in failed_records:
        assert record["attributes"]["exception.type"] == "ValueError"
        assert record["attributes"]["dask.task.key"] == attempts[0]["attributes"]["dask.task.key"]
        assert record["attributes"]["dask.cluster.id"] == next(iter(cluster_ids))

    # Metrics from the scheduler and from both workers, stamped with the same identity.
    def metric_sources(r):
        scheduler = r.metrics(name="dask.scheduler.tasks")
        workers = {
            p["attributes"].get("dask.worker.address") for p in r.metrics(name="dask.worker.memory")
        }
        durations = r.metrics(name="dask.task.duration")
        return scheduler and len(workers - {None}) >= 2 and durations and (scheduler, durations)

    scheduler_points, durations = rx.wait_for(metric_sources)
    assert {p["attributes"]["dask.cluster.id"] for p in scheduler_points} == cluster_ids
    assert {p["resource"]["service.name"] for p in durations} <= set(roles)
    assert any(p["attributes"]["dask.task.prefix"] == "slow_inc" for p in durations)
