"""The trace of a computation on an in-process cluster: one per submission, its graph
and task spans, tuple keys, failures, retries and reschedules, links to dependencies
(capped by ``otel.task.max-links``)."""

from __future__ import annotations

import dask
import pytest
from conftest import flush_emitters
from opentelemetry.trace import SpanKind, StatusCode
from span_checks import (
    assert_no_orphans,
    assert_task_ids_line_up,
    by_trace,
    carrier_of,
    cluster_and_client,
    fail,
    inc,
    only,
    task_spans_by_key,
)

from dask_otel import strings
from dask_otel.spans import ids

# -- the shape of a trace ---------------------------------------------------------------


def test_one_trace_per_submission(telemetry):
    with cluster_and_client() as (_, client):
        futures = client.map(inc, range(3))
        total = client.submit(sum, futures)
        assert total.result() == 6
        flush_emitters(client)
        cluster_id = client.scheduler_info()["id"]
        keys = [f.key for f in futures] + [total.key]

    spans = telemetry.spans()
    traces = by_trace(spans)
    assert len(traces) == 2
    # Data movement (transfer, get_data: also the client fetching results) is tested below.
    moving = {"transfer", "get_data", "rpc get_data"}
    shapes = sorted(
        sorted(s.name for s in trace_spans if s.name not in moving)
        for trace_spans in traces.values()
    )
    # One span per task, from the worker that computed it; none from the scheduler.
    assert shapes == [
        ["compute inc", "graph"] + ["task inc"] * 3,
        ["compute sum", "graph", "task sum"],
    ]

    for trace_spans in traces.values():
        compute = next(s for s in trace_spans if s.name.startswith("compute "))
        graph = only(trace_spans, "graph")
        assert compute.parent is None
        assert compute.kind == SpanKind.PRODUCER
        assert graph.parent is not None
        assert graph.parent.span_id == compute.context.span_id
        assert graph.kind == SpanKind.CONSUMER
        tasks = [s for s in trace_spans if s.name.startswith("task ")]
        assert graph.attributes["dask.graph.tasks"] == len(tasks)
        # Counts by final state, aggregated by the scheduler.
        assert graph.attributes["dask.graph.memory"] == len(tasks)
        assert graph.attributes["dask.graph.erred"] == 0
        assert graph.attributes["dask.graph.forgotten"] == 0
        for task in tasks:
            assert task.parent.span_id == graph.context.span_id
            assert task.attributes["dask.task.nbytes"] > 0
            assert task.attributes["dask.worker.address"].startswith("inproc://")
            assert isinstance(task.attributes["thread.id"], int)
            assert "dask.task.generation" not in task.attributes
            assert task.status.status_code == StatusCode.UNSET
            # The graph span covers its tasks; a task span covers its execution.
            assert graph.start_time <= task.start_time <= task.end_time <= graph.end_time
            compute_ns = task.attributes["dask.task.compute_seconds"] * 1e9
            assert 0 <= compute_ns <= task.end_time - task.start_time

    assert {s.attributes["dask.task.key"] for s in spans if s.name.startswith("task ")} == set(keys)
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)
    for span in spans:
        assert span.attributes["dask.cluster.id"] == cluster_id, span.name
        for key in keys:
            assert key not in span.name
            assert key.rsplit("-", 1)[-1] not in span.name  # not even the token


# -- tuple keys -------------------------------------------------------------------------


def test_tuple_key_of_a_submitted_task(telemetry):
    with cluster_and_client() as (_, client):
        future = client.submit(inc, 1, key=("x", 1))
        assert future.result() == 2
        flush_emitters(client)

    spans = telemetry.spans()
    task = only(spans, "task x")
    assert task.attributes["dask.task.key"] == "('x', 1)"
    carrier = carrier_of(spans, task.context.trace_id)
    assert task.context.span_id == ids.task_span_id(carrier, "('x', 1)")
    assert task.parent.span_id == carrier.span_id
    assert_no_orphans(spans)


def test_tuple_keys_of_a_dask_array(telemetry):
    da = pytest.importorskip("dask.array")
    with cluster_and_client() as (_, client):
        x = da.arange(12, chunks=3) + 1
        future = client.compute(x.sum())
        assert future.result() == 78
        flush_emitters(client)
        final_key = future.key

    spans = telemetry.spans()
    assert len(by_trace(spans)) == 1
    tasks = task_spans_by_key(spans)
    assert strings.key_to_str(final_key) in tasks
    tuple_keys = [k for k in tasks if k.startswith("(")]
    assert len(tuple_keys) >= 4  # one per chunk at least
    for key in tuple_keys:
        name, *indices = eval(key)  # the str() of a tuple key is its repr
        assert isinstance(name, str)
        assert all(isinstance(i, int) for i in indices)
        assert tasks[key].name == "task " + tasks[key].attributes["dask.task.prefix"]
        assert name not in tasks[key].name
    assert not [s for s in spans if s.name.startswith(("execute ", "attempt "))]
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)


# -- failures and retries ---------------------------------------------------------------


def test_failure_with_retries(telemetry):
    with cluster_and_client() as (_, client):
        future = client.submit(fail, 1, retries=1)
        with pytest.raises(ValueError, match="boom 1"):
            future.result()
        flush_emitters(client)

    spans = telemetry.spans()
    attempts = telemetry.spans("attempt fail")
    assert len(attempts) == 2
    # No worker finished it: its task span is the scheduler's.
    task = only(spans, "task fail")
    assert "dask.worker.name" not in task.attributes
    for attempt in attempts:
        assert attempt.status.status_code == StatusCode.ERROR
        (event,) = [e for e in attempt.events if e.name == "exception"]
        # Within the attempt, though its span is built later in the emitter thread.
        assert attempt.start_time <= event.timestamp <= attempt.end_time
        # The worker reads its own exception: builtin type name, str() as the message.
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "boom 1"
        stacktrace = event.attributes["exception.stacktrace"]
        assert stacktrace.startswith("Traceback (most recent call last):")
        assert "in fail" in stacktrace and stacktrace.endswith("ValueError: boom 1")
        assert attempt.attributes["error.type"] == "ValueError"
    # Both attempts beside the scheduler's task span, which links to them in order.
    first, retry = sorted(attempts, key=lambda s: s.start_time)
    assert first.parent.span_id == retry.parent.span_id == task.parent.span_id
    earlier = [link.context.span_id for link in task.links if "earlier" in str(link.attributes)]
    assert earlier == [first.context.span_id, retry.context.span_id]
    assert first.end_time <= retry.start_time
    assert [s.attributes.get("dask.task.generation", 0) for s in (first, retry)] == [0, 1]
    assert task.status.status_code == StatusCode.ERROR
    assert "ValueError" in task.status.description
    assert task.attributes["dask.task.attempts"] == 2
    assert task.attributes["dask.task.state"] == "erred"
    assert task.attributes["dask.task.generation"] == 2
    assert task.start_time <= first.start_time and retry.end_time <= task.end_time
    (event,) = [e for e in task.events if e.name == "exception"]
    assert event.attributes["exception.type"].endswith("ValueError")
    assert "boom 1" in event.attributes["exception.message"]
    # The last attempt's worker is named (two workers, the retry may land on either).
    workers = {e.attributes["dask.worker.address"] for e in attempts}
    assert set(task.attributes["dask.task.workers"]) <= workers
    assert_no_orphans(spans)
    assert_task_ids_line_up(spans)


def test_dependent_of_a_failed_task_is_erred_and_names_the_culprit(telemetry):
    with cluster_and_client() as (_, client):
        bad = client.submit(fail, 1)
        dependent = client.submit(inc, bad)
        with pytest.raises(ValueError, match="boom 1"):
            dependent.result()
        flush_emitters(client)
        bad_key = bad.key

    task = only(telemetry.spans(), "task inc")
    assert task.attributes["dask.task.state"] == "erred"
    assert task.attributes["dask.task.attempts"] == 0
    assert task.status.status_code == StatusCode.ERROR
    assert not telemetry.spans("attempt inc")  # it never ran
    assert_no_orphans(telemetry.spans())
    assert task.attributes["dask.task.erred_by"] == bad_key
    assert "exception" not in [e.name for e in task.events]
    assert task.status.description == "dependency erred"


# -- dependency links -------------------------------------------------------------------


def test_links_to_dependencies_in_the_same_graph(telemetry):
    with cluster_and_client() as (_, client):
        parts = [dask.delayed(inc)(i) for i in range(3)]
        total = dask.delayed(sum)(parts)
        assert client.compute(total).result() == 6
        flush_emitters(client)

    spans = telemetry.spans()
    assert len(by_trace(spans)) == 1
    total_span = only(spans, "task sum")
    inputs = telemetry.spans("task inc")
    assert len(inputs) == 3
    linked = {(link.context.trace_id, link.context.span_id) for link in total_span.links}
    assert linked == {(s.context.trace_id, s.context.span_id) for s in inputs}
    for link in total_span.links:
        assert link.attributes["dask.link"] == "dependency"
    for span in inputs:
        assert not span.links


def test_links_to_dependencies_from_an_earlier_submission(telemetry):
    with cluster_and_client() as (_, client):
        futures = client.map(inc, range(3))
        total = client.submit(sum, futures)
        assert total.result() == 6
        flush_emitters(client)

    total_span = only(telemetry.spans(), "task sum")
    inputs = telemetry.spans("task inc")
    # The inputs live in the trace of the `map`; the links point into it.
    assert {s.context.trace_id for s in inputs} != {total_span.context.trace_id}
    linked = {(link.context.trace_id, link.context.span_id) for link in total_span.links}
    assert linked == {(s.context.trace_id, s.context.span_id) for s in inputs}


# -- caps -------------------------------------------------------------------------------


def test_max_links(telemetry):
    """The worker's task span links to at most ``max-links`` dependencies' task spans."""
    with dask.config.set({"otel.task.max-links": 2}), cluster_and_client() as (_, client):
        parts = [dask.delayed(inc)(i) for i in range(5)]
        assert client.compute(dask.delayed(sum)(parts)).result() == 15
        flush_emitters(client)
    total = only(telemetry.spans(), "task sum")
    assert len(total.links) == 2
    inputs = {s.context.span_id for s in telemetry.spans("task inc")}
    assert {link.context.span_id for link in total.links} <= inputs

    telemetry.span_exporter.clear()
    with dask.config.set({"otel.task.max-links": 0}), cluster_and_client() as (_, client):
        assert client.submit(sum, client.map(inc, range(3))).result() == 6
        flush_emitters(client)
    assert telemetry.spans("task sum")
    assert not any(s.links for s in telemetry.spans("task"))


RESCHEDULED: list[int] = []


def reschedule_once(x):
    from distributed import Reschedule

    RESCHEDULED.append(x)
    if len(RESCHEDULED) == 1:
        raise Reschedule()
    return x


def test_a_rescheduled_attempt_says_so_and_is_no_error(telemetry):
    RESCHEDULED.clear()
    with cluster_and_client() as (_, client):
        assert client.submit(reschedule_once, 7).result() == 7
        flush_emitters(client)
    (attempt,) = telemetry.spans("attempt reschedule_once")
    (task,) = telemetry.spans("task reschedule_once")
    assert attempt.attributes["dask.task.rescheduled"] is True
    assert "dask.task.rescheduled" not in task.attributes
    assert {s.status.status_code for s in (attempt, task)} == {StatusCode.UNSET}
    assert attempt.parent.span_id == task.parent.span_id
    assert attempt.end_time <= task.start_time
    assert task.attributes["dask.task.generation"] == 1
    assert_task_ids_line_up(telemetry.spans())
    assert_no_orphans(telemetry.spans())
