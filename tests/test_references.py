"""What dask-otel keeps: nothing beyond what Dask keeps.

distributed's own ``test_worker_descopes_data``: once a failed task is released, nothing
from its frame, its inputs or its exception may be alive. Here the emitter thread is
held busy while the task fails and is released, so a reference queued for it (the
exception, its traceback, the objects in either) would still be alive when we look.
And a closed cluster leaves no dask-otel thread behind (distributed's leak checks wait
for every thread a test started), and a worker no connection of dask-otel's in its pool.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import ClassVar

from conftest import flush_emitters, in_process_cluster
from distributed import Scheduler, Worker, profile, wait
from opentelemetry.trace import StatusCode

from dask_otel.spans import emitter


def assert_none_alive(cls: type) -> None:
    with profile.lock:  # Dask's profiler holds frames while it samples
        gc.collect()
    assert not cls.instances
    assert not [o for o in gc.get_objects() if type(o) is cls]


def test_a_released_failure_leaves_nothing_alive(telemetry):
    class C:
        instances: ClassVar[weakref.WeakSet] = weakref.WeakSet()

        def __init__(self) -> None:
            C.instances.add(self)

    def f(x):
        y = C()
        raise Exception(x, y)

    hold = threading.Event()
    with in_process_cluster(n_workers=1) as client:
        (worker,) = client.cluster.workers.values()
        emitter.shared().submit(hold.wait, 60)  # nothing queued from now on is built yet
        try:
            f1 = client.submit(C, key="f1")
            f2 = client.submit(f, f1, key="f2")
            wait(f2)
            # The class as Dask's last unpickling of the graph left it (cloudpickle sets
            # the attributes of a class pickled by value each time it unpickles it).
            instances = C.instances
            del f1, f2
            deadline = time.monotonic() + 30
            while worker.state.tasks and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not worker.state.tasks
            assert_none_alive(C)
        finally:
            hold.set()
        flush_emitters(client)
        # Nor once the spans are built. Nothing unpickled the exception, which would run
        # the user's code, copy what it holds, and reset the class's attributes.
        assert C.instances is instances
        assert_none_alive(C)
    # The failure is still told, from what Dask reduced it to.
    (execute,) = telemetry.spans("attempt f2")
    assert execute.status.status_code is StatusCode.ERROR
    (event,) = [e for e in execute.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "Exception"
    assert "in f\n" in event.attributes["exception.stacktrace"]
    assert "C object at" in event.attributes["exception.message"]  # the repr: not literals


def dask_otel_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dask-otel")]


def test_a_closed_cluster_leaves_no_thread(telemetry):
    with in_process_cluster() as client:
        assert client.submit(sum, [1, 2]).result() == 3
        assert dask_otel_threads()  # the span emitter, at least
    assert not dask_otel_threads()


def test_a_worker_keeps_no_connection_of_dask_otel(telemetry):
    """dask-otel asks the scheduler for the cluster's id as a worker starts; the
    connection it used must not stay in the worker's pool. distributed's
    test_new_metrics_during_heartbeat counts the event-loop turns of a worker's first
    heartbeat, which plain opens that pooled connection: with one already there it took
    6 turns instead of more than 9."""

    def cluster_id_known(address: str) -> bool:
        data = telemetry.metric_reader.get_metrics_data()
        return any(
            point.attributes.get("dask.worker.address") == address
            and "dask.cluster.id" in point.attributes
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            for point in metric.data.data_points
        )

    async def pooled_after_start() -> int:
        async with (
            Scheduler(host="127.0.0.1", dashboard_address="127.0.0.1:0") as s,
            Worker(s.address, nthreads=1, heartbeat_interval="1h") as w,
        ):
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(cluster_id_known, w.address):
                assert time.monotonic() < deadline, "the worker never learned the cluster id"
                await asyncio.sleep(0.05)
            return w.rpc.open  # connections the worker's pool holds, idle or in use

    assert asyncio.run(pooled_after_start()) == 0
