"""A task that kills its worker process ends in KilledWorker: an ERROR `task` span that
names every worker the task died on, and an `attempt` span for each lost attempt."""

from __future__ import annotations

import os

import dask
import pytest
from conftest import flush_emitters, in_process_cluster
from distributed.scheduler import KilledWorker
from opentelemetry.trace import StatusCode


def die(x: int) -> int:
    os._exit(1)


def test_killed_worker_task_span(telemetry, monkeypatch):
    for signal in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{signal}_EXPORTER", "none")
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1}),
        in_process_cluster(processes=True, host="127.0.0.1") as client,
    ):
        with pytest.raises(KilledWorker):
            client.submit(die, 1).result(timeout=120)
        # Both Nannies restarted their workers: closed while one starts, distributed
        # 2025.9 counts the start against the close's deadline (TimeoutError under load).
        client.wait_for_workers(2, timeout=120)
        flush_emitters(client)

    (span,) = telemetry.spans("task die")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["dask.task.state"] == "erred"
    assert span.attributes["dask.task.attempts"] == 2
    (exc,) = [e for e in span.events if e.name == "exception"]
    assert exc.attributes["exception.type"] == "distributed.scheduler.KilledWorker"
    died_on = exc.attributes["dask.task.workers"]
    assert len(died_on) == 2 and len(set(died_on)) == 2
    # Each lost attempt, as the scheduler saw it go: both beside the task's span, under the
    # graph, linked from it in order.
    first, second = sorted(telemetry.spans("attempt die"), key=lambda s: s.start_time)
    assert [a.attributes["dask.worker.address"] for a in (first, second)] == list(died_on)
    for attempt in (first, second):
        assert attempt.status.status_code is StatusCode.ERROR
        assert attempt.attributes["dask.attempt.outcome"] == "worker-died"
    assert first.parent.span_id == second.parent.span_id == span.parent.span_id
    earlier = [link.context.span_id for link in span.links if "earlier" in str(link.attributes)]
    assert earlier == [first.context.span_id, second.context.span_id]
    spans = telemetry.spans()
    ids_ = [(s.context.trace_id, s.context.span_id) for s in spans]
    assert len(ids_) == len(set(ids_))
    assert all((s.parent.trace_id, s.parent.span_id) in ids_ for s in spans if s.parent)
