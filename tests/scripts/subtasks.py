"""Client of the subtask tests: ``fib`` computed by tasks that submit tasks.

Usage: python subtasks.py SCHEDULER_ADDRESS|processes|threads [--instrument] N

``processes``/``threads``: a two-worker ``LocalCluster`` with its workers in processes of
their own or in this one. ``--instrument`` calls ``dask_otel.instrument(client)``. Each
``fib`` task submits its two halves through ``worker_client``. Prints ``fib(N)``.
"""

from __future__ import annotations

import sys

from distributed import Client, LocalCluster, worker_client


def fib(n: int) -> int:
    if n < 2:
        return n
    with worker_client() as client:
        a, b = client.submit(fib, n - 1, pure=False), client.submit(fib, n - 2, pure=False)
        return a.result() + b.result()


def main() -> None:
    where, n = sys.argv[1], int(sys.argv[-1])
    options = {"n_workers": 2, "threads_per_worker": 1, "dashboard_address": "127.0.0.1:0"}
    if where == "processes":
        where = LocalCluster(processes=True, host="127.0.0.1", **options)
    elif where == "threads":
        where = LocalCluster(processes=False, **options)
    with Client(where, timeout=30) as client:
        if "--instrument" in sys.argv:
            import dask_otel

            dask_otel.instrument(client)
        client.wait_for_workers(2, timeout=60)
        print(client.submit(fib, n).result(), flush=True)


if __name__ == "__main__":
    main()
