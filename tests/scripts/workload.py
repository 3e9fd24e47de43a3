"""The client side of the end-to-end tests: a small computation with every feature.

Usage: python workload.py SCHEDULER_ADDRESS|local [--instrument] [--restart]

``local`` starts a ``LocalCluster`` with two worker processes. With ``--instrument`` it
calls ``dask_otel.instrument(client)``; otherwise it relies on ``opentelemetry-instrument``
(or on nothing, for an uninstrumented client). ``--restart`` restarts the workers and runs
``after_restart`` on each. Prints one JSON line with what it observed.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from distributed import Client, LocalCluster


def slow_inc(x: int) -> int:
    time.sleep(0.2)
    return x + 1


def log_marker(x: int) -> int:
    from opentelemetry import metrics

    logging.getLogger("user.task").warning("marker-from-task %d", x)
    metrics.get_meter("user.task").create_counter("user.marker").add(x)
    return x


def after_restart(x: int) -> int:
    return x


def fail(x: int) -> int:
    raise ValueError(f"injected failure {x}")


def main() -> None:
    address = sys.argv[1]
    if address == "local":
        cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
        )
        address = cluster.scheduler_address
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
            workers = list(client.scheduler_info()["workers"])
            client.gather(
                [client.submit(after_restart, i, workers=[w]) for i, w in enumerate(workers)]
            )
        print(json.dumps({"results": results, "logged": logged, "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
