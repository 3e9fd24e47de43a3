"""A worker preload that makes each task cost its worker's event loop more CPU, as
instrumentation does: the control for ``benchmarks/deployed.py --slowed US``.

When a task's result is in memory, the loop spins for ``SLOW_WORKER_US`` microseconds
(no telemetry, no span): what the scheduler's CPU per task does when workers are slower
for reasons of their own tells dask-otel's share of its increase from Dask's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin


class SlowWorker(WorkerPlugin):
    name = "slow-worker"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish == "memory":
            deadline = time.thread_time() + self.seconds
            while time.thread_time() < deadline:
                pass


async def dask_setup(worker: Any) -> None:
    await worker.plugin_add(SlowWorker(float(os.environ["SLOW_WORKER_US"]) / 1e6))
