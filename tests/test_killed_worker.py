"""A task that kills its worker process ends in KilledWorker: an ERROR `task` span that
names every worker the task died on, with each lost attempt among its events."""

from __future__ import annotations

import os

import dask
import pytest
from conftest import flush_emitters, in_process_cluster
from distributed.scheduler import KilledWorker
from opentelemetry.trace import StatusCode


def die(x: int) -> int:
    os._exit(1)


def test_killed_worker_task_span(telemetry, monkeypatch):
    for signal in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{signal}_EXPORTER", "none")
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1}),
        in_process_cluster(processes=True, host="127.0.0.1") as client,
    ):
        with pytest.raises(KilledWorker):
            client.submit(die, 1).result(timeout=120)
        flush_emitters(client)

    (span,) = telemetry.spans("task die")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["dask.task.state"] == "erred"
    assert span.attributes["dask.task.attempts"] == 2
    (exc,) = [e for e in span.events if e.name == "exception"]
    assert exc.attributes["exception.type"] == "distributed.scheduler.KilledWorker"
    died_on = exc.attributes["dask.task.workers"]
    assert len(died_on) == 2 and len(set(died_on)) == 2
    states = [e.name for e in span.events]
    assert states.count("processing") == 2 and "released" in states
