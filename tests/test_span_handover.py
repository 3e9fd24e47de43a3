"""A Nanny exports its worker's spans (``otel.nanny.export-spans``), end to end: real
``dask scheduler`` and ``dask worker`` processes under ``opentelemetry-instrument``,
exporting over OTLP/gRPC to a receiver on 127.0.0.1.

The worker only copies its spans to its flight recorder; its Nanny follows the copy and
exports it under the worker's resource, while the worker lives and after it is killed:
every span arrives once.
"""

from __future__ import annotations

import operator
import os
import signal
import threading
import time

import pytest
from conftest import flush_emitters, otel_env, start_scheduler, start_worker
from distributed import Client

TICKS = 200


def ticks(rx, batch: str) -> list:
    """The spans of the tasks of ``batch`` (their prefix)."""
    return rx.spans(name=f"task {batch}")


def run_ticks(client: Client, batch: str) -> None:
    """``TICKS`` tasks of prefix ``batch``, run and forgotten by the scheduler (a worker
    killed while it holds their results would compute them again)."""
    keys = [f"{batch}-{i}" for i in range(TICKS)]
    assert client.gather(client.map(operator.pos, range(TICKS), key=keys)) == list(range(TICKS))
    deadline = time.monotonic() + 30
    while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
        assert time.monotonic() < deadline, "the scheduler kept the tasks"
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "nanny_exports_spans", [True, False], ids=["nanny-exports", "worker-exports"]
)
def test_a_nanny_exports_its_workers_spans_once(receiver, processes, nanny_exports_spans):
    env = otel_env(receiver, DASK_OTEL__NANNY__EXPORT_SPANS=str(nanny_exports_spans))
    address = start_scheduler(processes, env)
    nanny = start_worker(processes, env, address, "w0")
    with Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        run_ticks(client, "alive")
        flush_emitters(client)
        # The worker process's pid and the names of its threads.
        ((worker_address, facts),) = client.run(
            lambda: {"pid": os.getpid(), "threads": [t.name for t in threading.enumerate()]}
        ).items()
        receiver.wait_for(lambda r: len(ticks(r, "alive")) >= TICKS)

        # Killed right after its spans were copied: its Nanny takes what it had not
        # taken yet once the process is gone.
        run_ticks(client, "killed")
        flush_emitters(client)
        os.kill(facts["pid"], signal.SIGKILL)
        client.wait_for_workers(1, timeout=60)
        run_ticks(client, "restarted")
        flush_emitters(client)
    assert processes.stop(nanny) == 0  # the Nanny sends what it holds
    receiver.wait_for(lambda r: len(ticks(r, "restarted")) >= TICKS)

    for batch in ("alive", "killed", "restarted"):
        spans = ticks(receiver, batch)
        assert sorted(s["attributes"]["dask.task.key"] for s in spans) == sorted(
            f"{batch}-{i}" for i in range(TICKS)
        ), batch
        assert len({(s["trace_id"], s["span_id"]) for s in spans}) == TICKS
        assert {s["resource"]["service.name"] for s in spans} == {"dask-worker"}
    first = ticks(receiver, "alive")
    assert {s["attributes"]["dask.worker.address"] for s in first} == {worker_address}
    # Where the Nanny exports them, the worker never starts a thread to export spans.
    assert ("dask-otel-export-traces" in facts["threads"]) is not nanny_exports_spans
