"""Log records that plain Python prints to stderr, from every process of a cluster.

Usage: python stderr_probe.py SCHEDULER_ADDRESS|local [--instrument]

No logging is configured anywhere: Python's last resort prints a logger's WARNING records
("probe: ..." only, no level or name), and ``logging.warning()`` configures the root
logger (``WARNING:root:...``, and so every later record). Each record is made in the
client, in a task, in a worker, in its Nanny and on the scheduler; a failing task makes
Dask print its own "Compute Failed". ``--instrument`` calls ``dask_otel.instrument()``
first (import and configure); ``local`` starts a ``LocalCluster`` of worker processes.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from distributed import Client, LocalCluster


def say(where: str) -> str:
    logging.getLogger(f"probe.{where}").warning("probe: %s warning", where)
    logging.getLogger(f"probe.{where}").info("probe: %s info, not printed", where)
    return where


def fail() -> None:
    raise ValueError("probe: task failure")


def main() -> None:
    if "--instrument" in sys.argv:
        import dask_otel

        dask_otel.instrument()
    address = sys.argv[1]
    if address == "local":
        cluster = LocalCluster(
            n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
        )
        address = cluster.scheduler_address
    with Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        say("client")
        assert client.submit(say, "task").result() == "task"
        client.run(say, "worker")
        client.run(say, "nanny", nanny=True)
        client.run_on_scheduler(say, "scheduler")
        with contextlib.suppress(ValueError):
            client.submit(fail).result()
        logging.warning("probe: root-level warning")  # configures the root logger
        say("after-basic-config")
    print("probe: done", flush=True)


if __name__ == "__main__":
    main()
