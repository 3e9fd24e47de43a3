"""The client side of the end-to-end tests: a small computation with every feature.

Usage: python workload.py SCHEDULER_ADDRESS [--instrument]

With ``--instrument`` it calls ``dask_otel.instrument(client)``; otherwise it relies on
``opentelemetry-instrument`` (or on nothing, for an uninstrumented client). Prints one
JSON line with what it observed.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from distributed import Client


def slow_inc(x: int) -> int:
    time.sleep(0.2)
    return x + 1


def log_marker(x: int) -> int:
    logging.getLogger("user.task").warning("marker-from-task %d", x)
    return x


def fail(x: int) -> int:
    raise ValueError(f"injected failure {x}")


def main() -> None:
    address = sys.argv[1]
    with Client(address, timeout=30) as client:
        if "--instrument" in sys.argv:
            import dask_otel

            dask_otel.instrument(client)
        client.wait_for_workers(2, timeout=60)
        results = client.gather(client.map(slow_inc, range(8)))
        logged = client.submit(log_marker, 7).result()
        try:
            client.submit(fail, 1, retries=1).result()
            failed = None
        except ValueError as e:
            failed = str(e)
        if "--restart" in sys.argv:
            client.restart()
            client.wait_for_workers(2, timeout=60)
            client.submit(slow_inc, 100, pure=False).result()
        print(json.dumps({"results": results, "logged": logged, "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
