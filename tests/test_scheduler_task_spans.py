"""``otel.scheduler.task-spans: all`` (trace model v1): the scheduler's span of every
task, with its state changes as events, and their caps."""

from __future__ import annotations

import dask
import pytest
from conftest import flush_emitters
from opentelemetry.trace import StatusCode
from span_checks import (
    assert_no_orphans,
    carrier_of,
    cluster_and_client,
    fail,
    inc,
    only,
    task_spans_by_key,
)

from dask_otel.spans import ids

# -- otel.scheduler.task-spans: all (trace model v1) -------------------------------------

ALL_TASK_SPANS = {"otel.scheduler.task-spans": "all"}


def test_scheduler_task_spans_all(telemetry):
    """Opt-in: the scheduler emits every task's span, with its state changes as events,
    and the worker an ``execute`` span under it per attempt."""
    with dask.config.set(ALL_TASK_SPANS), cluster_and_client() as (_, client):
        assert client.submit(sum, client.map(inc, range(3))).result() == 6
        with pytest.raises(ValueError):
            client.submit(fail, 1, retries=1).result()
        flush_emitters(client)
    spans = telemetry.spans()
    moving = {"transfer", "get_data", "rpc get_data"}
    expected = [
        *("compute inc", "graph", "task inc", "task inc", "task inc"),
        *("execute inc", "execute inc", "execute inc"),
        *("compute sum", "graph", "task sum", "execute sum"),
        *("compute fail", "graph", "task fail", "execute fail", "execute fail"),
    ]
    assert sorted(s.name for s in spans if s.name not in moving) == sorted(expected)
    tasks = task_spans_by_key(spans)
    for execute in (s for s in spans if s.name.startswith("execute ")):
        task = tasks[execute.attributes["dask.task.key"]]
        assert execute.parent.span_id == task.context.span_id
        carrier = carrier_of(spans, task.context.trace_id)
        assert task.context.span_id == ids.task_span_id(carrier, task.attributes["dask.task.key"])
        assert task.parent.span_id == carrier.span_id
    for task in telemetry.spans("task inc"):
        assert task.attributes["dask.task.state"] == "memory"
        assert task.attributes["dask.task.attempts"] == 1
        assert [e.name for e in task.events if e.name != "queued"] == ["processing"]
    failed = only(spans, "task fail")
    assert failed.attributes["dask.task.attempts"] == 2
    assert [e.name for e in failed.events][:2] == ["processing", "released"]
    assert {s.status.status_code for s in telemetry.spans("execute fail")} == {StatusCode.ERROR}
    (total,) = telemetry.spans("task sum")
    assert {link.context.span_id for link in total.links} == {
        s.context.span_id for s in telemetry.spans("task inc")
    }
    assert_no_orphans(spans)


def test_max_events_and_max_links_of_scheduler_task_spans(telemetry):
    settings = {**ALL_TASK_SPANS, "otel.task.max-events": 2, "otel.task.max-links": 2}
    with dask.config.set(settings), cluster_and_client() as (_, client):
        futures = client.map(inc, range(5))
        assert client.submit(sum, futures).result() == 15
        with pytest.raises(ValueError):  # 3 attempts: 7 states between start and end
            client.submit(fail, 1, retries=2).result()
        flush_emitters(client)

    tasks = telemetry.spans("task")
    assert len(tasks) == 7
    retried = only(tasks, "task fail")
    states = [e.name for e in retried.events if e.name != "exception"]
    # The first kept, and always the latest; the 5 others counted.
    assert states == ["processing", "processing"]
    assert retried.attributes["dask.task.dropped_events"] == 5
    for task in set(tasks) - {retried}:  # one may have been queued first
        assert [e.name for e in task.events][-1:] == ["processing"]
        assert "dask.task.dropped_events" not in task.attributes
    total = only(tasks, "task sum")
    assert len(total.links) == 2
    inputs = {s.context.span_id for s in telemetry.spans("task inc")}
    assert {link.context.span_id for link in total.links} <= inputs


def test_zero_links_and_events_of_scheduler_task_spans(telemetry):
    settings = {**ALL_TASK_SPANS, "otel.task.max-events": 0, "otel.task.max-links": 0}
    with dask.config.set(settings), cluster_and_client() as (_, client):
        assert client.submit(sum, client.map(inc, range(3))).result() == 6
        flush_emitters(client)
    for task in telemetry.spans("task"):
        assert not task.links
        assert not task.events
        assert task.attributes["dask.task.dropped_events"] >= 1  # processing, maybe queued
