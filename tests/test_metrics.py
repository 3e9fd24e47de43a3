"""Metrics: Dask's own numbers as OpenTelemetry instruments, read by a real SDK reader."""

from __future__ import annotations

import time

import dask
import dask.array as da
from conftest import flush_emitters, in_process_cluster, metrics_by_name
from distributed import Semaphore

from dask_otel.signals.instruments import INSTRUMENTS

#: Instruments that need something this workload does not do (spilling; gilknocker; an
#: SDK configured by dask-otel, see test_export_drops.py; a Nanny, test_post_mortem.py).
NOT_EXERCISED = {
    "dask.worker.spill.time",
    "dask.scheduler.gil.contention",
    "dask.worker.gil.contention",
    "dask_otel.exporter.dropped",
    "dask.nanny.worker.memory",
}


def points_by_name(reader) -> dict[str, tuple[str, list]]:
    # None from the reader: nothing collected since its last read.
    found = metrics_by_name(reader.get_metrics_data())
    return {name: (m.unit, list(m.data.data_points)) for name, m in found.items()}


def test_every_instrument_reports_with_identity(telemetry):
    with in_process_cluster() as client:
        x = da.ones((200, 200), chunks=50)
        assert float((x @ x.T).sum().compute()) == 200.0**3
        futures = client.map(lambda i: i, range(7), key=[f"ident-{i}" for i in range(7)])
        client.gather(futures)
        with Semaphore(max_leases=2, name="database"):
            pass
        cluster_id = client.scheduler_info()["id"]
        workers = set(client.scheduler_info()["workers"])
        flush_emitters(client)  # task durations are recorded by the workers' emitters
        found = points_by_name(telemetry.metric_reader)

    missing = set(INSTRUMENTS) - set(found) - NOT_EXERCISED
    assert not missing
    for name, (unit, points) in found.items():
        if name not in INSTRUMENTS:
            continue
        assert unit == INSTRUMENTS[name].unit, name
        for point in points:
            attributes = dict(point.attributes)
            assert attributes["dask.cluster.id"] == cluster_id, name
            if name.startswith("dask.worker.") or name == "dask.task.duration":
                assert attributes["dask.worker.address"] in workers, name
            expected = set(INSTRUMENTS[name].attributes)
            extra = set(attributes) - expected - {
                "dask.cluster.id", "dask.worker.address", "dask.worker.name"
            }  # fmt: skip
            assert not extra, (name, extra)

    # Every attempt is counted, traced or not; per prefix and outcome.
    _, durations = found["dask.task.duration"]
    ident = [p for p in durations if p.attributes["dask.task.prefix"] == "ident"]
    assert sum(p.count for p in ident) == 7
    assert {p.attributes["dask.task.outcome"] for p in ident} == {"success"}
    _, finished = found["dask.task.finished"]
    (ident_memory,) = [
        p
        for p in finished
        if p.attributes["dask.task.prefix"] == "ident"
        and p.attributes["dask.task.state"] == "memory"
    ]
    assert ident_memory.value == 7
    _, acquired = found["dask.scheduler.semaphore.acquired"]
    assert [(p.attributes["dask.semaphore.name"], p.value) for p in acquired] == [("database", 1)]
    _, workers_by_state = found["dask.scheduler.workers"]
    assert sum(p.value for p in workers_by_state) == 2


def test_scheduler_task_states_are_reported_at_zero(telemetry):
    """A scheduler that holds no task (none yet, or none since a restart cleared them)
    reports every state at 0, as Dask's Prometheus collector does, rather than no series."""
    with in_process_cluster():
        found = points_by_name(telemetry.metric_reader)
    _, points = found["dask.scheduler.tasks"]
    states = {p.attributes["dask.task.state"]: p.value for p in points}
    expected = {"released", "waiting", "no-worker", "queued", "processing", "memory", "erred"}
    assert states == dict.fromkeys(expected, 0)


def test_closed_servers_stop_reporting(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(sum, [1, 2]).result() == 3
    # Readers keep working after the cluster is gone; no point comes from the dead servers
    # (the reader's first answer is what the close's own flush collected).
    telemetry.metric_reader.get_metrics_data()
    found = points_by_name(telemetry.metric_reader)
    assert [n for n, (_, points) in found.items() if points] == []


def test_a_closed_clusters_last_points_are_exported_then_its_series_let_go(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(sum, [1, 2]).result() == 3
    exporter = telemetry.metric_exporter
    # The close's flush exported the task's duration...
    assert [point.count for point in exporter.points("dask.task.duration")][-1:] == [1]
    # ...and the SDK keeps none of the closed servers' series: a cumulative histogram
    # would be exported at every collection for as long as the process lives.
    closed = len(exporter.exports)
    telemetry.meter_provider.force_flush()
    assert [name for e in exporter.exports[closed:] for name, points in e.items() if points] == []


def test_a_blocked_event_loop_shows_in_the_tick_maximum(telemetry):
    import time

    with in_process_cluster(n_workers=1) as client:
        client.run_on_scheduler(lambda: time.sleep(0.6))  # blocks the scheduler's loop
        time.sleep(0.6)  # let Dask record the long tick
        found = points_by_name(telemetry.metric_reader)
        (point,) = found["dask.scheduler.event_loop.tick.max_duration"][1]
        assert point.value >= 0.5


def _observed(dask_worker) -> tuple[list[str], dict[str, int]]:
    """What this worker's process reports metrics of, and the clusters its records name."""
    from dask_otel import identity
    from dask_otel.signals import metrics

    return metrics.observed(), identity.hosted.clusters()


def test_a_forked_worker_reports_no_copy_of_its_parents_scheduler(telemetry):
    """A Nanny worker started with ``fork`` from the scheduler's process inherits its
    registrations: it must report its own worker only, not a frozen copy of the scheduler."""
    settings = {"distributed.worker.multiprocessing-method": "fork"}
    with (
        dask.config.set(settings),
        in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client,
    ):
        cluster_id = client.scheduler_info()["id"]
        client.wait_for_workers(1)
        deadline = time.monotonic() + 10  # the worker asks the scheduler for its id
        while not (seen := next(iter(client.run(_observed).values())))[1]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
    assert seen == (["worker"], {cluster_id: 1})
