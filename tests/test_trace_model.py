"""Trace model v2 under the events that make a task run again or not at all: every span id
is used once in its trace and every parent resolves in it (in-process clusters)."""

from __future__ import annotations

import threading
import time

import dask
import pytest
from conftest import flush_emitters, in_process_cluster
from distributed import Event
from distributed.scheduler import KilledWorker
from distributed.worker import WORKER_ANY_RUNNING
from opentelemetry.trace import StatusCode
from span_checks import assert_no_orphans, assert_task_ids_line_up

from dask_otel.spans import ids


def inc(x: int) -> int:
    return x + 1


def wait_for(event_name: str, x: int) -> int:
    Event(event_name).wait(30)
    return x


def executing(dask_worker) -> list[str]:
    return [str(k) for k, ts in dask_worker.state.tasks.items() if ts.state == "executing"]


def scheduled(key: str, dask_scheduler=None) -> bool:
    return key in dask_scheduler.tasks


def until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


async def remove_worker(address: str, dask_scheduler=None) -> None:
    """As when a worker dies: the scheduler drops it and what it held."""
    await dask_scheduler.remove_worker(address, stimulus_id="test-remove", close=True)


def no_stealing():
    return dask.config.set({"distributed.scheduler.work-stealing": False})


def test_a_result_lost_with_its_worker_is_computed_again_under_a_new_id(telemetry):
    with no_stealing(), in_process_cluster(n_workers=2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, key="x-1", workers=[a], allow_other_workers=True)
        assert x.result() == 2
        client.run_on_scheduler(remove_worker, a)
        until(lambda: a not in client.scheduler_info()["workers"])
        assert x.result() == 2  # computed again, on b
        assert client.submit(inc, x, key="y-1").result() == 3
        flush_emitters(client)

    spans = telemetry.spans()
    first, again = sorted(telemetry.spans("task x"), key=lambda s: s.start_time)
    assert first.attributes["dask.worker.address"] == a
    assert again.attributes["dask.worker.address"] == b
    assert "dask.task.generation" not in first.attributes
    assert again.attributes["dask.task.generation"] == 1
    assert first.context.span_id != again.context.span_id
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)


def test_an_attempt_lost_with_its_worker(telemetry):
    """The scheduler reports the lost attempt; the removed worker, still running the
    task in its thread, reports nothing for it; the rerun is the task's span."""
    with no_stealing(), in_process_cluster(n_workers=2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        future = client.submit(
            wait_for, "go-lost", 5, key="wait_for-lost", workers=[a], allow_other_workers=True
        )
        (removed,) = [w for w in client.cluster.workers.values() if w.address == a]
        until(lambda: client.run(executing, workers=[a])[a])
        client.run_on_scheduler(remove_worker, a)
        # Its task ends while it closes: the scheduler speaks for that attempt.
        until(lambda: removed.status.name != "running")
        Event("go-lost", client=client).set()
        assert future.result() == 5
        flush_emitters(client)

    spans = telemetry.spans()
    (attempt,) = telemetry.spans("attempt wait_for")
    (task,) = telemetry.spans("task wait_for")
    assert attempt.status.status_code == StatusCode.ERROR
    assert attempt.attributes["dask.worker.address"] == a
    assert task.attributes["dask.worker.address"] == b
    # Beside the task's span, which links to it.
    assert attempt.parent.span_id == task.parent.span_id
    assert [
        link.context.span_id
        for link in task.links
        if link.attributes["dask.link"] == ("earlier-attempt")
    ] == [attempt.context.span_id]
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)


def test_a_task_cancelled_while_running(telemetry):
    """No worker finished it: the scheduler's span says so; the worker's attempt, over
    after the cancellation, adds nothing (user spans in it nest under that span)."""
    with no_stealing(), in_process_cluster(n_workers=1) as client:
        (a,) = client.scheduler_info()["workers"]
        future = client.submit(wait_for, "go-cancel", 1, key="wait_for-cancel")
        until(lambda: client.run(executing, workers=[a])[a])
        future.cancel()
        # Only once the scheduler let it go does the task finish.
        until(lambda: not client.run_on_scheduler(scheduled, "wait_for-cancel"))
        Event("go-cancel", client=client).set()
        until(lambda: not client.run(executing, workers=[a])[a])
        assert client.submit(inc, 1).result() == 2
        flush_emitters(client)

    spans = telemetry.spans()
    (task,) = telemetry.spans("task wait_for")
    assert task.attributes["dask.task.state"] == "cancelled"
    assert "dask.task.attempts" not in task.attributes
    assert task.status.status_code == StatusCode.UNSET
    assert not telemetry.spans("attempt wait_for")
    (graph,) = [g for g in telemetry.spans("graph") if g.context.trace_id == task.context.trace_id]
    assert graph.attributes["dask.graph.forgotten"] == 1
    assert_no_orphans(spans)


def test_a_retried_task_thinned_out_of_its_graph_is_traced_from_its_retry(telemetry, tmp_path):
    """Thinned, failed once, retried: the failure's attempt span and the retry's task span
    (the scheduler marks the retry traced), parent and child."""
    marker = tmp_path / "failed"

    def fail_first(x: int) -> int:
        if not marker.exists():
            marker.touch()
            raise ValueError("first")
        return x

    settings = {"otel.task.sample-ratio": 0.0}
    with dask.config.set(settings), no_stealing(), in_process_cluster() as client:
        assert client.submit(fail_first, 3, retries=1, key="fail_first-1").result() == 3
        assert client.gather(client.map(inc, range(5))) == [1, 2, 3, 4, 5]
        flush_emitters(client)
    spans = telemetry.spans()
    assert {s.name for s in spans if s.name.startswith(("task", "attempt"))} == {
        "task fail_first",
        "attempt fail_first",
    }
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)


def test_killed_worker_in_process(telemetry):
    """Two workers removed while running the task (allowed-failures 1): KilledWorker, two
    lost attempts, one task span, all in one trace."""
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1}),
        no_stealing(),
        in_process_cluster(n_workers=3) as client,
    ):
        future = client.submit(wait_for, "go-killed", 1, key="wait_for-killed")
        removed = []
        for _ in range(2):
            until(lambda: any(client.run(executing).values()))
            (running,) = [w for w, keys in client.run(executing).items() if keys]
            removed += [w for w in client.cluster.workers.values() if w.address == running]
            client.run_on_scheduler(remove_worker, running)
        with pytest.raises(KilledWorker):
            future.result(timeout=30)
        # The removed workers' threads finish the task now: nothing of theirs counts once
        # they know they were removed (before that, a worker cut off from the scheduler
        # reports its attempt as it ended: failed once in CI, 1 run in 6 here).
        until(lambda: not any(w.status in WORKER_ANY_RUNNING for w in removed))
        Event("go-killed", client=client).set()
        until(lambda: not any(w.active_threads for w in removed))
        flush_emitters(client)
    spans = telemetry.spans()
    (task,) = telemetry.spans("task wait_for")
    assert task.status.status_code == StatusCode.ERROR
    assert task.attributes["dask.task.attempts"] == 2
    assert len(telemetry.spans("attempt wait_for")) == 2
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)


def test_an_odd_otel_annotation_never_breaks_a_graph(telemetry):
    """A user's ``otel`` annotation of any type: the graph is traced, its span ends."""
    np = pytest.importorskip("numpy")
    with in_process_cluster(n_workers=1) as client:
        with dask.annotate(otel=np.array([1, 2])):
            assert client.compute(dask.delayed(inc)(1)).result() == 2
        flush_emitters(client)
    (graph,) = telemetry.spans("graph")
    assert graph.attributes["dask.graph.memory"] == 1
    (task,) = telemetry.spans("task inc")
    assert task.parent.span_id == graph.context.span_id
    assert_no_orphans(telemetry.spans())


#: Span current in each task of the test below (in-process workers share this module).
SEEN: dict[str, int] = {}
SEEN_LOCK = threading.Lock()


def remember(key: str) -> str:
    from opentelemetry import trace

    with SEEN_LOCK:
        SEEN[key] = trace.get_current_span().get_span_context().span_id
    return key


def test_the_span_of_a_task_is_current_under_its_id_while_it_runs(telemetry):
    """What a log record or user span inside the task names is the emitted span's id."""
    SEEN.clear()
    with in_process_cluster() as client:
        assert client.gather(client.map(remember, ["a", "b", "c"])) == ["a", "b", "c"]
        flush_emitters(client)
    tasks = telemetry.spans("task remember")
    assert len(tasks) == 3
    (graph,) = telemetry.spans("graph")
    for span in tasks:
        key = span.attributes["dask.task.key"]
        assert span.context.span_id == ids.task_span_id(graph.context, key)
    assert set(SEEN.values()) == {s.context.span_id for s in tasks}
