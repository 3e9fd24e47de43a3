"""Client of the data-movement end-to-end test: idle, then transfers, then spilling.

Usage: python data_movement.py SCHEDULER_ADDRESS IDLE_SECONDS

Waits for two workers, stays idle for IDLE_SECONDS (heartbeats only), multiplies an array
by its transpose across both workers (dependency transfers), then persists more data on
one worker than its spill target and reads it back. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, wait


def main() -> None:
    address, idle = sys.argv[1], float(sys.argv[2])
    with Client(address, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)
        idle_start = time.time_ns()
        time.sleep(idle)
        idle_end = time.time_ns()

        x = da.random.random((1200, 1200), chunks=(300, 300))
        local = x.compute()
        product = float((x @ x.T).sum().compute())

        first = sorted(client.scheduler_info()["workers"])[0]
        # 16 chunks of 2 MB (da.ones would make broadcast views of a few bytes each).
        numbers = da.arange(4_000_000, chunks=250_000, dtype=float).persist(workers=[first])
        wait(numbers)
        spilled = client.run(lambda dask_worker: len(dask_worker.data.slow), workers=[first])
        total = float(numbers.sum().compute())
        print(
            json.dumps(
                {
                    "idle": [idle_start, idle_end],
                    "product_ok": bool(np.isclose(product, float((local @ local.T).sum()))),
                    "total": total,
                    "spilled_keys": spilled[first],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
