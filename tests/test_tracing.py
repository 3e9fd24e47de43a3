"""Traces of an in-process cluster: client, scheduler and worker spans and how they link.

Every test builds its LocalCluster inside the ``telemetry`` fixture, so the hooks give
its scheduler and workers dask-otel's plugins and all spans land in memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import dask
import pytest
from conftest import flush_emitters
from distributed import Client, LocalCluster
from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.trace import SpanKind, StatusCode

import dask_otel
from dask_otel.spans import ids

# -- helpers --------------------------------------------------------------------------------


@contextmanager
def cluster_and_client(**kwargs) -> Iterator[tuple[LocalCluster, Client]]:
    options = {
        "n_workers": 2,
        "threads_per_worker": 1,
        "processes": False,
        "dashboard_address": "127.0.0.1:0",
        **kwargs,
    }
    # No work stealing: a stolen task has extra states and attempts, which would make the
    # exact expectations below depend on timing.
    with dask.config.set({"distributed.scheduler.work-stealing": False}):
        cluster = LocalCluster(**options)
    with cluster, Client(cluster) as client:
        yield cluster, client


def inc(x):
    return x + 1


def fail(x):
    raise ValueError(f"boom {x}")


def by_trace(spans) -> dict[int, list]:
    traces = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    return traces


def only(spans, name: str):
    (span,) = [s for s in spans if s.name == name]
    return span


def task_spans_by_key(spans) -> dict[str, object]:
    """The task span of each key (of its latest generation, if it was computed again)."""
    out: dict[tuple[str, int], object] = {}
    for span in spans:
        if span.name.startswith("task "):
            key = (span.attributes["dask.task.key"], span.attributes.get("dask.task.generation", 0))
            assert key not in out, f"two task spans for {key}"
            out[key] = span
    return {key: span for (key, _), span in sorted(out.items(), key=lambda kv: kv[0][1])}


def graph_of(spans, trace_id):
    """The graph span of a trace: the context every task of it carries."""
    (graph,) = [
        s
        for s in spans
        if s.context.trace_id == trace_id and s.name.split(" ")[0] == "graph"  # or `graph <name>`
    ]
    return graph


def carrier_of(spans, trace_id):
    return graph_of(spans, trace_id).context


def assert_task_ids_line_up(spans) -> None:
    """Each task span has the id derived from (graph, key, generation) and the graph as
    parent; each attempt span has its generation's id and, as parent, the span of the
    next generation of the same task (a retry, or the task span)."""
    tasks = task_spans_by_key(spans)
    assert tasks
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    for span in spans:
        if not span.name.startswith(("task ", "attempt ")):
            continue
        key = span.attributes["dask.task.key"]
        carrier = carrier_of(spans, span.context.trace_id)
        generation = span.attributes.get("dask.task.generation", 0)
        assert span.context.span_id == ids.task_span_id(carrier, key, generation), span.name
        assert span.name.split(" ", 1)[1] == span.attributes["dask.task.prefix"]
        if span.name.startswith("task "):
            assert span.parent.span_id == carrier.span_id
            continue
        parent = by_id[span.context.trace_id, span.parent.span_id]
        assert parent.attributes["dask.task.key"] == key
        assert parent.context.span_id == ids.task_span_id(carrier, key, generation + 1)
        while parent.name.startswith("attempt "):  # retries, then the task's span
            parent = by_id[parent.context.trace_id, parent.parent.span_id]
        assert parent.name.startswith("task ") and parent.attributes["dask.task.key"] == key


def assert_no_orphans(spans) -> None:
    """Every parent resolves inside its trace, and no span id is used twice in one."""
    present = [(s.context.trace_id, s.context.span_id) for s in spans]
    assert len(present) == len(set(present)), "a span id used twice"
    for span in spans:
        if span.parent is not None:
            assert span.parent.trace_id == span.context.trace_id
            assert (span.parent.trace_id, span.parent.span_id) in set(present), span.name


def scheduler_plugins(client: Client) -> list[str]:
    return client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))


def worker_plugins(client: Client) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: list(dask_worker.plugins))


# -- (a) the shape of a trace ---------------------------------------------------------------


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


# -- (b) tuple keys -------------------------------------------------------------------------


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
    assert ids.key_to_str(final_key) in tasks
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


# -- (c) failures and retries ---------------------------------------------------------------


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
    # The first attempt under the retry, the retry under the task's span.
    first, retry = sorted(attempts, key=lambda s: s.start_time)
    assert first.parent.span_id == retry.context.span_id
    assert retry.parent.span_id == task.context.span_id
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


# -- (d) dependency links -------------------------------------------------------------------


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


# -- (e) user code inside a task ------------------------------------------------------------


#: Where a task finds the test's tracer provider (same process: processes=False).
USER_CODE: dict[str, object] = {}


def work(x):
    logging.getLogger("user").warning("working on %s", x)
    # The task's own span, as user code finds it: what is done to it shows on `task`.
    task_span = trace.get_current_span()
    task_span.set_attribute("user.rows", x)
    task_span.add_event("user.checkpoint", {"user.step": 1})
    tracer = trace.get_tracer("user-code", tracer_provider=USER_CODE["tracer_provider"])
    with tracer.start_as_current_span("user-span"):
        return x * 2


def test_user_span_and_log_inside_a_task(telemetry):
    USER_CODE["tracer_provider"] = telemetry.tracer_provider
    try:
        with cluster_and_client() as (_, client):
            assert client.submit(work, 21).result() == 42
            flush_emitters(client)
    finally:
        USER_CODE.clear()

    spans = telemetry.spans()
    execute = only(spans, "task work")
    user = only(spans, "user-span")
    assert user.parent is not None
    assert user.parent.span_id == execute.context.span_id
    assert user.context.trace_id == execute.context.trace_id
    assert execute.start_time <= user.start_time <= user.end_time <= execute.end_time
    assert execute.attributes["user.rows"] == 21
    (checkpoint,) = [e for e in execute.events if e.name == "user.checkpoint"]
    assert checkpoint.attributes["user.step"] == 1
    assert execute.start_time <= checkpoint.timestamp <= user.start_time
    assert_no_orphans(spans)

    records = [r for r in telemetry.logs() if r.body == "working on 21"]
    assert len(records) == 1  # exported once, whatever loggers it passed
    (record,) = records
    assert record.trace_id == execute.context.trace_id
    assert record.span_id == execute.context.span_id
    assert record.severity_number == SeverityNumber.WARN


def test_log_outside_a_task_has_no_span(telemetry):
    with cluster_and_client() as (_, client):
        client.submit(inc, 1).result()
        logging.getLogger("user").warning("outside")
    (record,) = [r for r in telemetry.logs() if r.body == "outside"]
    assert not record.trace_id
    assert not record.span_id


# -- (f) client not instrumented ------------------------------------------------------------


def test_uninstrumented_client_gets_a_root_graph_span(telemetry):
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
    ) as cluster:
        dask_otel.DaskInstrumentor().uninstrument()
        with Client(cluster) as client:
            assert "dask-otel" in scheduler_plugins(client)
            assert all("dask-otel" in p for p in worker_plugins(client).values())
            futures = client.map(inc, range(3))
            assert client.submit(sum, futures).result() == 6
            flush_emitters(client)
            cluster_id = client.scheduler_info()["id"]

    spans = telemetry.spans()
    assert not telemetry.spans("compute")
    traces = by_trace(spans)
    assert len(traces) == 2
    # Named after what ran, as the client's `compute` span would be.
    roots = sorted(s.name for s in spans if s.name.startswith("graph"))
    assert roots == ["graph inc", "graph sum"]
    for trace_spans in traces.values():
        (graph,) = [s for s in trace_spans if s.name in roots]
        assert graph.parent is None
        assert graph.kind == SpanKind.INTERNAL
        for span in trace_spans:
            if span.name.startswith("task "):
                assert span.parent.span_id == graph.context.span_id
    assert len(telemetry.spans("task ")) == 4
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)
    assert all(s.attributes["dask.cluster.id"] == cluster_id for s in spans)


# -- (g) uninstrument -----------------------------------------------------------------------


def test_no_plugins_after_uninstrument(telemetry):
    with cluster_and_client() as (_, client):
        assert "dask-otel" in scheduler_plugins(client)
        assert all("dask-otel" in p for p in worker_plugins(client).values())

    dask_otel.DaskInstrumentor().uninstrument()

    with cluster_and_client() as (_, client):
        assert "dask-otel" not in scheduler_plugins(client)
        plugins = worker_plugins(client)
        assert len(plugins) == 2
        assert all("dask-otel" not in p for p in plugins.values())
        assert client.submit(inc, 1).result() == 2
        assert not any(client.run(lambda dask_worker: "execute" in vars(dask_worker)).values())
    assert not telemetry.spans()


# -- (h) disabled by config -----------------------------------------------------------------


def test_disabled_by_config(telemetry):
    with dask.config.set({"otel.enabled": False}), cluster_and_client() as (_, client):
        futures = client.map(inc, range(3))
        assert client.submit(sum, futures).result() == 6
        flush_emitters(client)
        patched = client.run(lambda dask_worker: "execute" in vars(dask_worker))
    assert telemetry.spans() == []
    assert not any(patched.values())


def test_disabled_client_with_an_enabled_cluster(telemetry):
    """`enabled` is read by each component: a disabled client sends no context."""
    with cluster_and_client() as (_, client):
        with dask.config.set({"otel.enabled": False}):
            assert client.submit(inc, 1).result() == 2
        flush_emitters(client)
    assert not telemetry.spans("compute")
    assert only(telemetry.spans(), "graph inc").parent is None
    assert_task_ids_line_up(telemetry.spans())


# -- (i) caps -------------------------------------------------------------------------------


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


# -- (i') otel.scheduler.task-spans: all (trace model v1) -------------------------------------

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


# -- (j) instrument(client) -----------------------------------------------------------------


def test_instrument_and_uninstrument_an_asynchronous_client(telemetry):
    """With ``Client(asynchronous=True)`` both return awaitables, as the client's methods
    do; before, they registered nothing and said nothing."""
    dask_otel.DaskInstrumentor().uninstrument()  # a cluster without dask-otel to start

    def plugins(dask_scheduler=None, dask_worker=None):
        return "dask-otel" in (dask_scheduler or dask_worker).plugins

    async def main() -> list[bool]:
        async with (
            LocalCluster(
                n_workers=1, processes=False, asynchronous=True, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            seen = [await client.run_on_scheduler(plugins)]
            await dask_otel.instrument(client, tracer_provider=telemetry.tracer_provider)
            seen += [await client.run_on_scheduler(plugins), *(await client.run(plugins)).values()]
            await dask_otel.uninstrument(client)
            seen += [await client.run_on_scheduler(plugins), *(await client.run(plugins)).values()]
            return seen

    assert asyncio.run(main()) == [False, True, True, False, False]


def test_instrument_an_asynchronous_client_with_dask_otel_off(telemetry):
    """Off (``otel.enabled: false``), ``await dask_otel.instrument(client)`` still works."""

    async def main() -> bool:
        async with (
            LocalCluster(
                n_workers=1, processes=False, asynchronous=True, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            await dask_otel.instrument(client)
            await dask_otel.uninstrument(client)
            return True

    with dask.config.set({"otel.enabled": False}):
        assert asyncio.run(main())


def test_instrument_client_twice_then_uninstrument(telemetry):
    # Start from a cluster without dask-otel: the fixture's instrumentation would add it.
    dask_otel.DaskInstrumentor().uninstrument()
    with cluster_and_client() as (_, client):
        assert "dask-otel" not in scheduler_plugins(client)

        def plugin_ids(dask_scheduler=None, dask_worker=None):
            server = dask_scheduler or dask_worker
            plugin = server.plugins.get("dask-otel")
            return id(plugin) if plugin is not None else None

        providers = {
            "tracer_provider": telemetry.tracer_provider,
            "meter_provider": telemetry.meter_provider,
            "logger_provider": telemetry.logger_provider,
        }
        dask_otel.instrument(client, **providers)
        first = (client.run_on_scheduler(plugin_ids), client.run(plugin_ids))
        dask_otel.instrument(client, **providers)
        second = (client.run_on_scheduler(plugin_ids), client.run(plugin_ids))
        assert first[0] is not None
        assert all(v is not None for v in first[1].values())
        assert second == first  # registered once: the second call replaced nothing

        def wrapped_once(dask_worker):
            execute = vars(dask_worker).get("execute")
            tracer = getattr(execute, "__self__", None)
            return tracer is not None and getattr(tracer.original, "__self__", None) is dask_worker

        assert all(client.run(wrapped_once).values())

        assert client.submit(inc, 1).result() == 2
        flush_emitters(client)
        names = sorted(s.name for s in telemetry.spans())
        # get_data: the client fetching the result from the worker.
        assert names == ["compute inc", "get_data", "graph", "task inc"]

        dask_otel.uninstrument(client)
        assert "dask-otel" not in scheduler_plugins(client)
        assert all("dask-otel" not in p for p in worker_plugins(client).values())
        assert not any(client.run(lambda dask_worker: "execute" in vars(dask_worker)).values())

        assert client.submit(inc, 2).result() == 3
        assert len(telemetry.spans()) == 4  # nothing new


def test_task_span_is_current_in_the_task_thread(telemetry):
    """The task span is current in the task's thread and not after it."""

    def current_span_id(_):
        return trace.get_current_span().get_span_context().span_id

    with cluster_and_client() as (_, client):
        first, second = client.gather(client.map(current_span_id, [1, 2]))
        flush_emitters(client)
    tasks = telemetry.spans("task current_span_id")
    assert len(tasks) == 2
    assert {first, second} == {s.context.span_id for s in tasks}
    assert trace.get_current_span().get_span_context().span_id == 0


def test_task_span_names_its_thread_whatever_the_task_sets(telemetry):
    """``thread.id`` is the thread the attempt ran in; the task's own ``set_attribute``
    calls land on the span, but cannot overwrite what Dask knows."""
    import threading

    def tag(_):
        span = trace.get_current_span()
        span.set_attribute("thread.id", -1)
        span.set_attribute("user.tag", "mine")
        return threading.get_ident()

    with cluster_and_client() as (_, client):
        thread = client.submit(tag, 1).result()
        flush_emitters(client)
    (task,) = telemetry.spans("task tag")
    assert task.attributes["thread.id"] == thread
    assert task.attributes["user.tag"] == "mine"


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
    assert attempt.parent.span_id == task.context.span_id
    assert task.attributes["dask.task.generation"] == 1
    assert_task_ids_line_up(telemetry.spans())
    assert_no_orphans(telemetry.spans())


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
    assert attempt.parent.span_id == task.context.span_id
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


# -- transfers ------------------------------------------------------------------------------


def test_transfer_and_get_data_join_the_traces_of_their_tasks(telemetry):
    with cluster_and_client() as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, workers=[a], key="x-1")
        y = client.submit(inc, x, workers=[b], key="y-1")
        assert y.result() == 3
        flush_emitters(client)

    spans = telemetry.spans()
    task_x, task_y = only(spans, "task x"), only(spans, "task y")
    transfer = only(spans, "transfer")
    # x is sent to worker b; y's result to the client, also a get_data (in y's trace).
    (get_data,) = [
        s for s in spans if s.name == "get_data" and s.attributes["dask.worker.address"] == a
    ]
    # Fetching y's input on worker b: in y's trace, under y's task span.
    assert transfer.parent.span_id == task_y.context.span_id
    assert transfer.context.trace_id == task_y.context.trace_id
    assert transfer.kind == SpanKind.CLIENT
    assert transfer.attributes["dask.worker.address"] == b
    assert transfer.attributes["dask.peer.address"] == a
    assert transfer.attributes["dask.transfer.keys"] == 1
    assert transfer.attributes["dask.transfer.outcome"] == "success"
    # The request it made: a CLIENT span beneath it (the client's own gather is untraced).
    request = only(spans, "rpc get_data")
    assert request.parent.span_id == transfer.context.span_id
    assert request.kind == SpanKind.CLIENT
    assert request.attributes["server.address"] == a  # inproc://: no host and port
    # Sending x from worker a: in x's trace, under x's task span.
    assert get_data.parent.span_id == task_x.context.span_id
    assert get_data.context.trace_id == task_x.context.trace_id
    assert get_data.kind == SpanKind.SERVER
    assert get_data.attributes["dask.worker.address"] == a
    assert get_data.attributes["dask.transfer.bytes"] > 0


def test_a_transfer_serving_one_task_links_to_nothing(telemetry):
    """Both inputs of one task fetched together: the transfer's parent is that task, and
    it links to no task twice (nor to its own parent)."""
    with cluster_and_client() as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        x1 = client.submit(inc, 1, workers=[a], key="x-1")
        x2 = client.submit(inc, 2, workers=[a], key="x-2")
        assert client.gather([x1, x2]) == [2, 3]
        z = client.submit(sum, [x1, x2], workers=[b], key="z-1")
        assert z.result() == 5
        flush_emitters(client)

    spans = telemetry.spans()
    transfer = only(spans, "transfer")
    assert transfer.attributes["dask.transfer.keys"] == 2
    assert transfer.parent.span_id == only(spans, "task z").context.span_id
    assert not transfer.links
