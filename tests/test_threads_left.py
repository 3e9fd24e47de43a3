"""A Dask program under ``opentelemetry-instrument`` keeps no thread of dask-otel's once its
servers are done with, as distributed's own tests require: their leak check fails a test
that leaves a thread it started running for 5 s, and waits until then for it to end.

dask-otel starts its threads with the first work and ends them when idle, so that a
process that never uses Dask runs none (tests/test_process_startup.py). What they must
not do is wait on: for the export schedule (``OTEL_BLRP_SCHEDULE_DELAY``: every test that
closes a cluster took 1 s longer, Dask's closing log lines waiting for their batch; a
client's spans waited up to the 5 s of ``OTEL_BSP_SCHEDULE_DELAY``), or for a server that
was stopped without closing (distributed's test_nanny.py test_scheduler_file failed: the
metric thread ticked on).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import bin_path, otel_env
from otlp_receiver import OTLPReceiver

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
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="otlp",
        # Long enough that a thread waiting for either would be seen waiting.
        OTEL_BSP_SCHEDULE_DELAY="30000",
        OTEL_BLRP_SCHEDULE_DELAY="30000",
        OTEL_METRIC_EXPORT_INTERVAL="60000",
    )
    done = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, "-c", PROLOGUE + program + LEFT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    left, waited = done.stdout.rsplit(" ", 1)
    assert left == "[]", done.stdout
    # Within the look for stopped servers (every 0.2 s), well inside distributed's 5 s.
    assert float(waited) < 4, done.stdout
    if sent is not None:  # sent, not dropped
        received = [s["name"] for s in receiver.spans()]
        received += [str(r["body"]) for r in receiver.log_records()]
        assert any(sent in item for item in received), received
