"""A small Dask workload to look at in Jaeger and Grafana.

Run it under ``opentelemetry-instrument`` so that its computations start the traces the
scheduler and the workers continue::

    opentelemetry-instrument python examples/demo_client.py tcp://scheduler:8786

The scheduler address comes from the first argument, else from ``DASK_SCHEDULER_ADDRESS``.
The workload: an array reduction spread over the workers, a task that logs a line (the
record carries the task's trace id), and a task that fails twice (``retries=1``), whose
error the client catches. Exits 0.
"""

from __future__ import annotations

import logging
import os
import sys

import dask.array as da
from distributed import Client


def greet(name: str) -> str:
    """A task that logs: the record is exported with the trace and span of its attempt."""
    logger = logging.getLogger("demo")
    logger.setLevel(logging.INFO)
    logger.info("hello from a Dask task, %s", name)
    return f"hello, {name}"


def fail(x: int) -> int:
    """A task that always raises: both attempts show up as errors in the trace."""
    raise ValueError(f"cannot process {x}")


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else os.environ.get("DASK_SCHEDULER_ADDRESS")
    if not address:
        print("usage: demo_client.py SCHEDULER_ADDRESS (or set DASK_SCHEDULER_ADDRESS)")
        return 2

    with Client(address, timeout="60s") as client:
        client.wait_for_workers(2, timeout=120)

        # 16 chunks moved and reduced across the workers: `compute mean` in Jaeger.
        x = da.random.default_rng(42).random((4000, 4000), chunks=(1000, 1000))
        result = (x + x.T).mean().compute()
        print(f"array reduction: {result:.6f}")

        print(client.submit(greet, "dask-otel").result())

        future = client.submit(fail, 1, retries=1)
        try:
            future.result()
        except ValueError as error:
            print(f"failing task, caught as expected: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
