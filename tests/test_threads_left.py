"""A Dask program under ``opentelemetry-instrument`` keeps no thread of dask-otel's once its
servers are done with, as distributed's own tests require: their leak check fails a test
that leaves a thread it started running for 5 s, and waits until then for it to end.

dask-otel starts its threads with the first work and ends them when idle, so that a
process that never uses Dask runs none (tests/test_process_startup.py). What they must
not do is wait on: for the export schedule (``OTEL_BLRP_SCHEDULE_DELAY``: every test that
closes a cluster took 1 s longer, Dask's closing log lines waiting for their batch; a
client's spans waited up to the 5 s of ``OTEL_BSP_SCHEDULE_DELAY``), or for a server that
was stopped without closing (distributed's test_nanny.py test_scheduler_file failed: the
metric thread ticked on); nor for an export the collector fails or never answers, which
the exporter retries or waits for up to its timeout (10 s).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import bin_path, otel_env
from otlp_receiver import UNANSWERED, OTLPReceiver, exporting_env, unanswered

#: The program's end: waits up to 10 s for the threads dask-otel started meanwhile to
#: end, then prints those still running and how long it waited.
LEFT = """
deadline = time.monotonic() + 10
started = time.monotonic()
while time.monotonic() < deadline:
    left = sorted(t.name for t in threading.enumerate() if t not in before and ours(t.name))
    if not left:
        break
    time.sleep(0.01)
print(left, round(time.monotonic() - started, 2))
"""

PROLOGUE = """
import asyncio, threading, time
from distributed import Client, Nanny, Scheduler, Worker

def ours(name):
    return name.startswith(("dask-otel", "OtelPeriodic"))

before = set(threading.enumerate())
"""

#: Servers closed as a program closes them, then Dask's own closing log lines.
CLOSED = """
async def main():
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        async with Worker(s.address, host="127.0.0.1") as w:
            async with Client(s.address, asynchronous=True) as c:
                assert await c.submit(sum, [1, 2]) == 3

asyncio.run(main())
"""

#: distributed's test_nanny.py::test_scheduler_file: the scheduler only stopped.
STOPPED = """
async def main():
    s = await Scheduler(host="127.0.0.1", dashboard_address=":0")
    async with Nanny(s.address, host="127.0.0.1"):
        pass
    s.stop()

asyncio.run(main())
"""


#: A client of a cluster in other processes (distributed's ``c`` fixture): its ``compute``
#: spans waited for the traces' schedule (5 s), as long as the leak check waits.
CLIENT_ONLY = """
from distributed.utils_test import cluster

with cluster(nworkers=1) as (scheduler, _):
    with Client(scheduler["address"]) as c:
        assert c.submit(sum, [1, 2]).result() == 3
"""


SIGNALS = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_LOGS_EXPORTER": "otlp",
}


def threads_left_after(program: str, env: dict[str, str]) -> float:
    """Run ``program`` under ``opentelemetry-instrument``; check that no thread of
    dask-otel's outlives it, and return how long after its end the last one ran."""
    done = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, "-c", PROLOGUE + program + LEFT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    left, waited = done.stdout.rsplit(" ", 1)
    assert left == "[]", done.stdout + done.stderr[-3000:]
    return float(waited)


@pytest.mark.parametrize(
    ("program", "sent"),
    [
        (CLOSED, "Scheduler closing all comms"),  # a log line after the servers' last flush
        (STOPPED, None),
        (CLIENT_ONLY, "compute sum"),
    ],
    ids=["closed", "stopped", "client-only"],
)
def test_no_thread_of_dask_otels_waits_on_after_the_servers(
    receiver: OTLPReceiver, program: str, sent: str | None
) -> None:
    env = otel_env(
        receiver,
        **SIGNALS,
        # Long enough that a thread waiting for either would be seen waiting.
        OTEL_BSP_SCHEDULE_DELAY="30000",
        OTEL_BLRP_SCHEDULE_DELAY="30000",
        OTEL_METRIC_EXPORT_INTERVAL="60000",
    )
    # Within the look for stopped servers (every 0.2 s), well inside distributed's 5 s.
    assert threads_left_after(program, env) < 4
    if sent is not None:  # sent, not dropped
        received = [s["name"] for s in receiver.spans()]
        received += [str(r["body"]) for r in receiver.log_records()]
        assert any(sent in item for item in received), received


#: A Nanny's worker in its own process, and its scheduler in this one.
NANNY = """
async def main():
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        async with Nanny(s.address, host="127.0.0.1"):
            async with Client(s.address, asynchronous=True) as c:
                assert await c.submit(sum, [1, 2]) == 3

asyncio.run(main())
"""

#: A LocalCluster of worker processes, with its client, as a script runs one.
LOCAL = """
from distributed import LocalCluster

with LocalCluster(n_workers=1, threads_per_worker=1, host="127.0.0.1",
                  dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
    assert client.submit(sum, [1, 2]).result() == 3
"""

#: distributed's test_batched.py and test_core.py: Dask's log lines, and no server at all.
NO_SERVER = """
import logging

logging.getLogger("distributed.core").error("a log line of Dask's, no server here")
time.sleep(1.0)  # its batch left, and failed or waits for an answer
"""


@pytest.mark.parametrize(
    ("kind", "protocol"),
    [*((kind, "grpc") for kind in UNANSWERED), ("down", "http")],
    ids=[*UNANSWERED, "down, OTLP/HTTP"],
)
@pytest.mark.parametrize(
    ("program", "bound"),
    [
        (CLOSED, 1.0),
        (NANNY, 1.0),
        (LOCAL, 1.0),
        (STOPPED, 2.0),  # the span emitter's thread ends after a second without work
        (NO_SERVER, 1.0),
    ],
    ids=["worker", "nanny", "local", "stopped", "no-server"],
)
def test_a_closed_cluster_leaves_no_thread_whatever_the_collector_does(
    kind: str, protocol: str, program: str, bound: float
) -> None:
    """With the collector down or hung, exports fail or hang for the exporter's whole
    timeout (10 s a batch, retries included): none may keep a thread of dask-otel's
    running once the cluster has closed (or stopped), and nothing waits for them."""
    with unanswered(kind) as endpoint:
        env = exporting_env(
            endpoint,
            protocol,
            **SIGNALS,
            # Batches and metrics leave while the cluster runs: exports are under way, in
            # their retries or awaiting an answer, when it closes.
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_BLRP_SCHEDULE_DELAY="100",
            OTEL_METRIC_EXPORT_INTERVAL="300",
        )
        waited = threads_left_after(program, env)
    print(f"\n{kind}: the threads of dask-otel's gone {waited} s after the end")
    assert waited < bound
