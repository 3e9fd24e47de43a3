"""The client side of the post-mortem test: workers that die under tasks.

Usage: python post_mortem.py SCHEDULER_ADDRESS

1. ``ticks`` quick tasks on each worker (their spans wait in the workers' export queues),
   then a task that allocates memory until its worker's Nanny kills it, twice: the
   client gets KilledWorker (the scheduler allows one failure).
2. Once both workers are back, quick tasks and a task that sleeps on one worker, whose
   process the client kills with SIGKILL while the task runs; the task is retried.

Prints one JSON line with what it observed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from distributed import Client
from distributed.scheduler import KilledWorker

TICKS = 30


def tick(x: int) -> int:
    return x


def hog(step_mb: int) -> int:
    """Allocate ``step_mb`` MB every 50 ms, for good."""
    logging.getLogger("user.hog").warning("hog: allocating %d MB every 50 ms", step_mb)
    chunks = []
    while True:
        chunks.append(b"x" * (step_mb * 2**20))  # written: resident at once
        time.sleep(0.05)


def sleeper(marker: str) -> str:
    logging.getLogger("user.sleeper").warning("sleeper: started, sleeping")
    time.sleep(0.5)  # the worker's emitter builds the spans of the tasks before
    Path(marker).touch()
    time.sleep(3)
    return "slept"


def spans_built(dask_worker) -> bool:
    """Whether the worker's dask-otel plugin built the spans of every attempt so far."""
    return dask_worker.plugins["dask-otel"].flush(30)


def main() -> None:
    address = sys.argv[1]
    observed: dict = {}
    with Client(address, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)
        workers = sorted(client.scheduler_info()["workers"])
        for worker in workers:
            client.gather(client.map(tick, range(TICKS), workers=[worker], key=None, pure=False))
        future = client.submit(hog, 10, key="hog-0")
        try:
            future.result(timeout=120)
        except KilledWorker as e:
            observed["killed_worker"] = str(e)
        observed["hog_workers"] = workers

        client.wait_for_workers(2, timeout=60)
        deadline = time.monotonic() + 60
        while len(client.scheduler_info()["workers"]) < 2 or set(
            client.scheduler_info()["workers"]
        ) & set(workers):
            assert time.monotonic() < deadline, "workers did not come back"
            time.sleep(0.1)
        target = sorted(client.scheduler_info()["workers"])[0]
        client.gather(client.map(tick, range(TICKS), workers=[target], pure=False))
        marker = Path(f"sleeper-{os.getpid()}.started")
        future = client.submit(
            sleeper, str(marker), key="sleeper-0", workers=[target], allow_other_workers=True
        )
        while not marker.exists():
            time.sleep(0.05)
        pid = client.run(os.getpid, workers=[target])[target]
        os.kill(pid, signal.SIGKILL)
        observed["sigkill_worker"] = target
        observed["sigkill_pid"] = pid
        observed["sleeper"] = future.result(timeout=120)
        # The workers build a finished task's span on a thread of their own, moments
        # later: built before the test stops them, it waits in their export queues (and
        # flight recorders) for their Nannies to send, which is what the test checks.
        assert all(client.run(spans_built).values())
    print(json.dumps(observed))


if __name__ == "__main__":
    main()
