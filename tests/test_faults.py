"""Reliability under faults, with real processes and real OTLP exporters.

A collector that is not there, goes away, hangs or comes back changes no result and never
blocks an event loop; export resumes when it is back. Stopping a scheduler, worker, nanny
or client waits a bounded time with the collector down, and delivers what it holds with
the collector up. A worker killed mid-task leaves its lost attempt on the task's span.

Processes export straight to 127.0.0.1: an ``OTLPReceiver``, a closed port or a
``StalledCollector`` (accepts, never answers). The time bounds asserted here are
functional ("the loop never stalls for a second while every export hangs for ten", "a
SIGTERM'd process is gone within 15 s"), generous for a slow shared machine; the
measured values are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import operator
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import cloudpickle
import dask
import pytest
from conftest import (
    bin_path,
    flush_emitters,
    in_process_cluster,
    otel_env,
    start_scheduler,
    start_worker,
)
from distributed import Client
from opentelemetry.trace import StatusCode
from otlp_receiver import OTLPReceiver, StalledCollector, closed_port

from dask_otel.spans import ids

# The probes below run inside the scheduler and worker processes, which cannot import
# this module: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Longest event-loop stall tolerated while exports fail or hang (they take up to 10 s).
MAX_LOOP_LAG = 2.0
#: Longest a SIGTERM'd scheduler or worker, or a finished client, may take to exit with
#: the collector down: otel.flush-timeout (5 s) to close, at most as long again at exit
#: (the SDK alone waits 30 s per batch processor there).
MAX_EXIT = 15.0
#: A Nanny first closes its worker (a flush, then the worker's exit), then exits itself.
MAX_EXIT_WITH_NANNY = 20.0
#: Every export of a process whose delivery must come from its stop, not its schedule.
NEVER = {
    "OTEL_BSP_SCHEDULE_DELAY": "600000",
    "OTEL_BLRP_SCHEDULE_DELAY": "600000",
    "OTEL_METRIC_EXPORT_INTERVAL": "600000",
}

#: What a process says at exit of what it could not export.
LOSS_AT_EXIT = re.compile(r"dask-otel: collector unreachable at \S+: \d+ (spans|log records)")

CLIENT = """
import operator, sys, time
from distributed import Client
with Client(sys.argv[1], timeout=30) as client:
    total = client.submit(sum, client.map(operator.add, range(50), range(50))).result()
print(total, time.time(), flush=True)
"""


class Endpoint:
    """What ``otel_env`` needs: an OTLP/gRPC endpoint."""

    def __init__(self, port: int) -> None:
        self.grpc_endpoint = f"http://127.0.0.1:{port}"


# -- event-loop probe (runs in the scheduler and worker processes) -----------------------


async def _probe(state: dict, period: float = 0.02) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        state["max"] = max(state["max"], now - last - period)
        last = now


async def start_probe(dask_scheduler=None, dask_worker=None) -> None:
    """Measure how late the event loop wakes a 20 ms sleep, from now on."""
    server = dask_scheduler or dask_worker
    server._fault_probe = {"max": 0.0}
    server._fault_probe_task = asyncio.ensure_future(_probe(server._fault_probe))


def read_probe(dask_scheduler=None, dask_worker=None) -> float:
    """Longest event-loop stall since the last read."""
    state = (dask_scheduler or dask_worker)._fault_probe
    longest, state["max"] = state["max"], 0.0
    return longest


def probe_all(client: Client) -> None:
    client.run_on_scheduler(start_probe)
    client.run(start_probe)


def loop_lag(client: Client) -> float:
    """Longest event-loop stall of the scheduler and every worker since the last call."""
    return max([client.run_on_scheduler(read_probe), *client.run(read_probe).values()])


# -- workloads ---------------------------------------------------------------------------


def work(client: Client, tag: str, n: int = 200) -> None:
    """A map, a reduction and a failing task under key prefix ``tag``: results checked."""
    keys = [f"{tag}-{i}" for i in range(n)]
    added = client.map(operator.add, range(n), range(n), key=keys)
    assert client.submit(sum, added, key=f"{tag}sum-0").result() == n * (n - 1)
    with pytest.raises(ZeroDivisionError):
        client.submit(operator.truediv, 1, 0, key=f"{tag}fail-0").result()


def sigterm(proc: subprocess.Popen, group: bool = False) -> float:
    """SIGTERM (to the process, or its whole group); seconds until it exited with 0."""
    started = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0
    return time.monotonic() - started


def run_client(processes, env: dict[str, str], address: str) -> float:
    """An instrumented client script: checks its result, returns how long its exit took."""
    out = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, "-c", CLIENT, address],
        env=env, capture_output=True, text=True, timeout=120, cwd=processes.tmp_path,
    )  # fmt: skip
    ended = time.time()
    assert out.returncode == 0, out.stdout + out.stderr
    total, printed = out.stdout.split()
    assert int(total) == 2450
    return ended - float(printed)


def complaints(text: str) -> list[str]:
    """Tracebacks, and what dask-otel says other than its documented loss counts (while
    running, and at exit)."""
    return [
        line
        for line in text.splitlines()
        if "Traceback (most recent call last)" in line
        or ("dask-otel:" in line and " lost: " not in line and not LOSS_AT_EXIT.search(line))
    ]


def processes_of(rx: OTLPReceiver, name: str, **attributes: str) -> set[str]:
    """``service.instance.id`` of every process that sent spans called ``name``."""
    return {
        s["resource"]["service.instance.id"]
        for s in rx.spans(name=name)
        if all(s["attributes"].get(k) == v for k, v in attributes.items())
    }


# -- collector faults --------------------------------------------------------------------


def test_collector_unreachable_from_the_start(processes):
    """Nothing listens on the endpoint: results, loop and stops are unaffected."""
    env = otel_env(Endpoint(closed_port()))
    address = start_scheduler(processes, env)
    scheduler = processes.procs[-1][0]
    worker = start_worker(processes, env, address, "w0")  # with a Nanny
    with Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        probe_all(client)
        started = time.monotonic()
        for i in range(3):  # spans, logs and metrics pile up; exports fail and back off
            work(client, f"down{i}")
        while time.monotonic() - started < 6:  # into the 1, 2 and 4 s retry backoffs
            time.sleep(0.5)
        lag = loop_lag(client)
        client_exit = run_client(processes, env, address)
    worker_exit = sigterm(worker)  # the Nanny: it closes its worker, which flushes
    scheduler_exit = sigterm(scheduler)
    print(
        f"\nunreachable: loop lag {lag:.3f}s, client exit {client_exit:.2f}s, "
        f"worker+nanny exit {worker_exit:.2f}s, scheduler exit {scheduler_exit:.2f}s"
    )
    assert lag < MAX_LOOP_LAG
    assert client_exit < MAX_EXIT
    assert worker_exit < MAX_EXIT_WITH_NANNY
    assert scheduler_exit < MAX_EXIT
    assert not complaints(processes.logs()), processes.logs()


def test_collector_goes_away_comes_back_and_hangs(processes):
    """Up, gone, back on the same port (export resumes), then hung (nothing blocks)."""
    rx = OTLPReceiver().start()
    try:
        env = otel_env(rx)
        address = start_scheduler(processes, env)
        start_worker(processes, env, address, "w0", nanny=False)
        with Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            probe_all(client)
            work(client, "up")
            # The workers' task spans, the scheduler's for the task that failed.
            rx.wait_for(lambda r: r.spans(name="task up") and r.spans(name="task upfail"))

            rx.stop()  # the collector goes away: exports fail, retry, give up
            work(client, "gone")
            time.sleep(3)  # into the retry backoffs of those exports
            gone_lag = loop_lag(client)

            rx = rx.restarted()  # back on the same port
            work(client, "back")
            rx.wait_for(
                lambda r: (
                    len(r.spans(name="task back")) == 200
                    and r.spans(name="task backfail")
                    and [x for x in r.log_records() if "backfail-0" in str(x["body"])]
                    and r.metrics(name="dask.worker.memory")
                    and r.metrics(name="dask.scheduler.tasks")
                ),
                timeout=60,
            )
            rx.stop()

            # A hung collector: connections accepted, requests never answered, every
            # export waits for its 10 s timeout.
            port = int(rx.grpc_endpoint.rsplit(":", 1)[1])
            with StalledCollector(port) as stalled:
                work(client, "hung")
                deadline = time.monotonic() + 30
                while stalled.connections < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert stalled.connections >= 2  # the scheduler's and the worker's exports
                loop_lag(client)
                hung_started = time.monotonic()
                work(client, "hung2")
                client_exit = run_client(processes, env, address)
                while time.monotonic() - hung_started < 5:
                    time.sleep(0.5)
                hung_lag = loop_lag(client)
                client.close()
                exits = [sigterm(p, group=True) for p, _ in reversed(processes.procs)]
    finally:
        rx.stop()
    print(
        f"\ncollector gone: loop lag {gone_lag:.3f}s; hung: loop lag {hung_lag:.3f}s, "
        f"client exit {client_exit:.2f}s, SIGTERM exits {[round(e, 2) for e in exits]}"
    )
    assert gone_lag < MAX_LOOP_LAG
    assert hung_lag < MAX_LOOP_LAG
    assert client_exit < MAX_EXIT
    assert all(e < MAX_EXIT for e in exits)
    assert not complaints(processes.logs()), processes.logs()


# -- graceful stops deliver --------------------------------------------------------------


def test_graceful_stops_deliver_what_was_recorded(receiver, processes):
    """Exports scheduled for much later: only the stop itself can deliver them."""
    env = otel_env(receiver, **NEVER)
    address = start_scheduler(processes, env)
    scheduler = processes.procs[-1][0]
    worker = start_worker(processes, env, address, "w0")
    with Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        (worker_address,) = client.scheduler_info()["workers"]
        work(client, "kept", n=20)
        # A client process exports at exit (dask-otel's bounded shutdown, not the SDK's).
        run_client(processes, env, address)
        receiver.wait_for(lambda r: r.spans(name="compute add"))
        assert not receiver.spans(name="task kept")  # nothing else sent so far
        assert not receiver.spans(name="task keptfail")

    assert sigterm(worker) < MAX_EXIT_WITH_NANNY  # to the Nanny, which closes its worker
    receiver.wait_for(lambda r: len(r.spans(name="task kept")) == 20)
    receiver.wait_for(lambda r: r.spans(name="attempt keptfail"))
    worker_ids = processes_of(receiver, "task kept")
    assert len(worker_ids) == 1
    # This test's own record: a Nanny also sends what dead workers of other Nannies on
    # this machine left unexported (an earlier test's, say), under their own resources.
    failed = receiver.wait_for(
        lambda r: [x for x in r.log_records() if "Key:       keptfail-0" in str(x["body"])]
    )
    assert failed[0]["resource"]["service.instance.id"] in worker_ids
    assert failed[0]["attributes"]["dask.worker.address"] == worker_address
    durations = receiver.wait_for(lambda r: r.metrics(name="dask.task.duration"))
    assert {p["resource"]["service.instance.id"] for p in durations} == worker_ids
    assert {p["attributes"]["dask.task.prefix"] for p in durations} >= {"kept", "keptfail"}
    # The scheduler still holds its spans: the failed task's, the graphs'.
    assert not receiver.spans(name="task keptfail")

    assert sigterm(scheduler) < MAX_EXIT
    receiver.wait_for(
        lambda r: (
            r.spans(name="task keptfail")
            and len([s for s in r.spans() if s["name"].startswith("graph")]) >= 3
        )
    )
    removed = receiver.wait_for(
        lambda r: [x for x in r.log_records() if x["event_name"] == "dask.remove-worker"]
    )
    assert removed[0]["attributes"]["dask.worker.address"] == worker_address
    receiver.wait_for(lambda r: r.metrics(name="dask.scheduler.tasks"))


# -- a worker killed mid-task ------------------------------------------------------------


def executing(dask_worker) -> list[str]:
    return [str(k) for k, ts in dask_worker.state.tasks.items() if ts.state == "executing"]


def test_worker_killed_mid_task_is_a_lost_attempt(telemetry, monkeypatch):
    """SIGKILL while the task runs: the rerun succeeds; the scheduler's span and the
    remove-worker record show the attempt that was lost, and on which worker."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    key = f"sleepy-{uuid.uuid4().hex[:6]}"
    with (
        dask.config.set({"distributed.scheduler.work-stealing": False}),
        in_process_cluster(processes=True, host="127.0.0.1") as client,
    ):
        victim = next(iter(client.scheduler_info()["workers"]))
        pid = client.run(os.getpid, workers=[victim])[victim]
        future = client.submit(time.sleep, 3, key=key, workers=[victim], allow_other_workers=True)
        deadline = time.monotonic() + 60
        while key not in client.run(executing, workers=[victim])[victim]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        assert future.result(timeout=120) is None
        flush_emitters(client)

    # The scheduler reports the lost attempt; the worker that reran it, the task span
    # (its process exports nowhere here). The scheduler has no task span to emit.
    (attempt,) = telemetry.spans("attempt sleepy")
    assert not telemetry.spans("task sleepy")
    assert attempt.status.status_code == StatusCode.ERROR
    assert attempt.attributes["dask.worker.address"] == victim
    assert attempt.attributes["dask.attempt.outcome"] == "worker-died"
    # Its id is the attempt's (what the dead worker's own records named), its parent the
    # graph, beside the span of the task's next generation, which the rerun emits.
    (graph,) = telemetry.spans("graph")
    assert attempt.context.span_id == ids.task_span_id(graph.context, key)
    assert attempt.parent.span_id == graph.context.span_id

    (removed,) = [
        r
        for r in telemetry.logs()
        if r.event_name == "dask.remove-worker" and r.attributes["dask.worker.address"] == victim
    ]
    assert key in removed.body["processing-tasks"]
