"""What user code inside a task sees: the task span is current in its thread, its own
spans nest under it, its log records carry it, and what it sets cannot overwrite Dask's."""

from __future__ import annotations

import logging

from conftest import flush_emitters
from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from span_checks import assert_no_orphans, cluster_and_client, inc, only

# -- user code inside a task ------------------------------------------------------------


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
