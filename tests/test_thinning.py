"""Large graphs: the span budget (``otel.task.max-spans-per-graph``) is spent
deterministically, on the tasks the prefix filters keep; failed and slow tasks are kept."""

from __future__ import annotations

import os

import dask
import pytest
from conftest import flush_emitters
from opentelemetry.trace import StatusCode
from span_checks import (
    assert_no_orphans,
    assert_task_ids_line_up,
    carrier_of,
    cluster_and_client,
    fail,
    inc,
)

from dask_otel.spans import ids

# -- thinning ---------------------------------------------------------------------------


def slow(x):
    import time

    time.sleep(0.3)
    return x


def test_large_graphs_are_thinned_deterministically(telemetry):
    with (
        dask.config.set({"otel.task.max-spans-per-graph": 10}),
        cluster_and_client() as (_, client),
    ):
        futures = client.map(inc, range(40))
        assert client.gather(futures) == list(range(1, 41))
        flush_emitters(client)
        keys = [f.key for f in futures]

    (graph,) = telemetry.spans("graph")
    assert graph.attributes["dask.graph.tasks"] == 40
    assert graph.attributes["dask.graph.span_ratio"] == 0.25
    carrier = carrier_of(telemetry.spans(), graph.context.trace_id)
    expected = {k for k in keys if ids.keep_task(carrier, k, 0.25)}
    assert 0 < len(expected) < 40
    tasks = {s.attributes["dask.task.key"] for s in telemetry.spans("task inc")}
    assert tasks == expected
    assert_task_ids_line_up(telemetry.spans())
    assert_no_orphans(telemetry.spans())


def test_excluded_prefixes_get_no_task_spans(telemetry):
    with (
        dask.config.set({"otel.task.exclude-prefixes": ["inc"]}),
        cluster_and_client() as (_, client),
    ):
        assert client.submit(sum, client.map(inc, range(3))).result() == 6
        flush_emitters(client)
    assert not telemetry.spans("task inc") and not telemetry.spans("attempt inc")
    assert telemetry.spans("task sum")


def double(x):
    return 2 * x


def test_the_span_budget_goes_to_the_tasks_the_prefix_filters_keep(telemetry):
    """One graph of 40 tasks, 10 of them chosen by prefix, a budget of 10 spans: every
    chosen task is traced (the budget is not spread over the tasks the filter left out)."""
    settings = {"otel.task.max-spans-per-graph": 10, "otel.task.include-prefixes": ["inc"]}
    graph = [dask.delayed(inc)(i) for i in range(10)] + [dask.delayed(double)(i) for i in range(30)]
    with dask.config.set(settings), cluster_and_client() as (_, client):
        assert client.gather(client.compute(graph)) == [*range(1, 11), *range(0, 60, 2)]
        flush_emitters(client)
    (graph_span,) = telemetry.spans("graph")
    assert graph_span.attributes["dask.graph.tasks"] == 40
    assert len(telemetry.spans("task inc")) == 10
    assert not telemetry.spans("task double") and not telemetry.spans("attempt double")


def fail_once(marker: str) -> str:
    """Fails the first time it runs (``marker``: a path), then succeeds."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise ValueError("first attempt")
    return "second attempt"


def test_a_thinned_task_that_failed_once_keeps_the_parent_of_its_failed_attempt(
    telemetry, tmp_path
):
    """The worker reports the failed attempt of a thinned task; the task succeeds on its
    retry, whose worker emits the ``task`` span all the same: no ``attempt`` is orphaned."""
    with dask.config.set({"otel.task.sample-ratio": 0.0}), cluster_and_client() as (_, client):
        marker = str(tmp_path / "failed-once")
        assert client.submit(fail_once, marker, retries=1).result() == "second attempt"
        flush_emitters(client)
    (task,) = telemetry.spans("task fail_once")
    assert task.attributes["dask.task.generation"] == 1
    assert task.status.status_code == StatusCode.UNSET
    (attempt,) = telemetry.spans("attempt fail_once")  # the failed attempt
    assert attempt.status.status_code == StatusCode.ERROR
    assert attempt.parent.span_id == task.parent.span_id
    assert [link.context.span_id for link in task.links] == [attempt.context.span_id]
    assert_no_orphans(telemetry.spans())


def test_thinned_tasks_that_fail_or_are_slow_are_kept(telemetry):
    settings = {"otel.task.sample-ratio": 0.0, "otel.task.keep-slower-than": "100ms"}
    with dask.config.set(settings), cluster_and_client() as (_, client):
        with pytest.raises(ValueError):
            client.submit(fail, 1, retries=1).result()
        assert client.submit(slow, 5).result() == 5
        assert client.gather(client.map(inc, range(5))) == [1, 2, 3, 4, 5]
        flush_emitters(client)

    assert not telemetry.spans("task inc") and not telemetry.spans("attempt inc")
    (failed,) = telemetry.spans("task fail")
    assert failed.status.status_code == StatusCode.ERROR
    assert len(telemetry.spans("attempt fail")) == 2
    (slow_task,) = telemetry.spans("task slow")  # its worker's, timed by Dask
    assert slow_task.end_time - slow_task.start_time >= 0.25e9
    assert not telemetry.spans("attempt slow")
    assert_task_ids_line_up(telemetry.spans())
    assert_no_orphans(telemetry.spans())


def test_no_task_spans_means_no_attempt_spans_retried_or_not(telemetry, tmp_path):
    """``otel.spans.tasks: false`` holds for every attempt: neither the failed one nor
    its retry makes a span (the retry of a task thinned out of a traced graph would)."""
    with dask.config.set({"otel.spans.tasks": False}), cluster_and_client() as (_, client):
        marker = str(tmp_path / "failed-once")
        assert client.submit(fail_once, marker, retries=1).result() == "second attempt"
        flush_emitters(client)
    names = {s.name for s in telemetry.spans()}
    assert "graph" in names
    assert not {n for n in names if n.startswith(("task ", "attempt "))}, names
