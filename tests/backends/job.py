"""The client's job in the real-backend test, run as README says:
``opentelemetry-instrument python job.py SCHEDULER OUT.json``.

Every computation a Dask user meets in a working day, each its own trace: an array
reduction with transfers between hosts and spilling, a task that fails once and is
retried, one that fails for good, a KilledWorker (a task over its worker's memory limit,
twice), a P2P rechunk, the user's own span around two computations, log lines from inside
tasks. OUT.json names what ran and how it ended, for the test to find in the backends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import dask
import dask.array as da
from distributed import Client, KilledWorker
from opentelemetry import trace

#: A file every host sees (the namespaces share the file system): a retried task fails
#: the first time only.
FLAKY_MARK = Path(os.environ.get("JOB_FLAKY_MARK", "/tmp/dask-otel-flaky"))


def flaky(x: int) -> int:
    if not FLAKY_MARK.exists():
        FLAKY_MARK.write_text("failed once")
        raise RuntimeError("flaky: first attempt fails")
    return x + 1


def fail_for_good(x: int) -> int:
    raise ValueError(f"cannot process {x}")


def hog_memory(nbytes: int) -> int:
    """Touches more memory than its worker may have: the Nanny kills the worker."""
    held = b"\x01" * nbytes
    time.sleep(30)
    return len(held)


def log_inside(i: int) -> int:
    logging.getLogger("job").warning("inside task %d", i)
    return i * i


def sampling_probe(i: int) -> int:
    return i


def sampling_probe_error(i: int) -> int:
    raise ValueError(f"probe {i} fails")


def probes(client: Client, fine: int, failing: int) -> dict[str, object]:
    """Computations of one task each, to count what tail sampling keeps."""
    for i in range(fine):
        client.submit(sampling_probe, i).result()
    for i in range(failing):
        with contextlib.suppress(ValueError):
            client.submit(sampling_probe_error, i).result()
    return {"fine": fine, "failing": failing}


def job(client: Client) -> dict[str, object]:
    outcome: dict[str, object] = {}
    x = da.random.default_rng(7).random((3000, 3000), chunks=(500, 500))
    persisted = (x + x.T).persist()
    outcome["reduction"] = float(persisted.sum().compute())
    del persisted

    outcome["retried"] = client.submit(flaky, 1, retries=1).result()

    try:
        client.submit(fail_for_good, 2).result()
    except ValueError as error:
        outcome["failed"] = str(error)

    try:
        client.submit(hog_memory, int(os.environ["JOB_HOG_BYTES"])).result()
    except KilledWorker as error:
        outcome["killed_worker"] = type(error).__name__
    client.wait_for_workers(4, timeout=120)

    y = da.ones((2000, 2000), chunks=(2000, 50))
    with dask.config.set({"array.rechunk.method": "p2p"}):
        outcome["p2p_rechunk"] = float(y.rechunk((50, 2000)).sum().compute())

    with trace.get_tracer("job").start_as_current_span("nightly report") as span:
        first = client.compute(da.arange(1000, chunks=100).sum()).result()
        second = sum(client.gather(client.map(log_inside, range(8))))
        outcome["user_span"] = [int(first), int(second)]
        outcome["user_trace_id"] = format(span.get_span_context().trace_id, "032x")
    return outcome


def main(mode: str, address: str, out: Path) -> int:
    with Client(address, timeout="60s") as client:
        client.wait_for_workers(4, timeout=120)
        outcome = job(client) if mode == "job" else probes(client, fine=40, failing=3)
    out.write_text(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
