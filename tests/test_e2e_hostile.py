"""The issue's hostile user on a real cluster: tasks that fail on a non-UTF-8 file name,
log it, put it on spans, use NUL and megabyte keys and attributes, next to a hundred
ordinary tasks. A scheduler and a worker under ``opentelemetry-instrument`` export over
OTLP/gRPC to the test receiver: every ordinary task's span and record arrives, and no
export fails."""

from __future__ import annotations

import pytest
from conftest import HERE, otel_env, start_scheduler, start_worker
from distributed import Client
from scripts.hostile_tasks import FILE, MEGABYTE, inc, log, mark, parse

NEIGHBOURS = 100


def wait_for_neighbours(receiver):
    def arrived(r):
        spans = r.spans()
        incs = {s["attributes"]["dask.task.key"] for s in spans if s["name"] == "task inc"}
        nul = [s for s in spans if s["name"] == "task nul\x00"]
        opened = [s for s in spans if s["name"].startswith("open ")]
        # A task's span ends after the spans its function opened: waited for on its own.
        marked = [s for s in spans if s["name"] == "task mark"]
        failed = [s for s in spans if s["name"] == "attempt parse"]
        big = [s for s in spans if s["name"].startswith("task mmm")]
        logged = [x for x in r.log_records() if str(x["body"]).startswith("neighbour")]
        return (
            len(incs) == NEIGHBOURS
            and nul
            and len(opened) == len(marked) == 5
            and failed
            and big
            and len(logged) == NEIGHBOURS
        )

    receiver.wait_for(arrived, timeout=90)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_hostile_strings_cost_no_neighbour(receiver, processes, protocol):
    env = otel_env(receiver, protocol, PYTHONPATH=str(HERE))
    address = start_scheduler(processes, env)
    start_worker(processes, env, address, "worker")
    with Client(address, timeout=60) as client:
        client.wait_for_workers(1, timeout=90)
        futures = client.map(inc, range(NEIGHBOURS))
        futures.append(client.submit(inc, 0, key="nul\x00-1"))
        futures.append(client.submit(inc, 0, key=MEGABYTE + "-1"))
        failing = client.submit(parse, FILE)
        futures += client.map(log, range(NEIGHBOURS))
        futures.append(client.submit(log, -1, FILE))
        futures += client.map(mark, [FILE] * 5, pure=False)
        client.gather(futures)
        with pytest.raises(ValueError, match="cannot parse"):
            failing.result()
        # Still in the same batches as the hostile items: nothing was lost.
        wait_for_neighbours(receiver)

    spans = receiver.spans()
    # The worker's span of the failed attempt has the message as the task raised it.
    (failed,) = [s for s in spans if s["name"] == "attempt parse"]
    assert failed["status_message"] == "ValueError: cannot parse /data/caf\ufffd.csv"
    (nul,) = [s for s in spans if s["name"] == "task nul\x00"]
    assert nul["attributes"]["dask.task.key"] == "nul\x00-1"
    (big,) = [s for s in spans if s["name"].startswith("task mmm")]
    assert len(big["attributes"]["dask.task.key"]) == len(big["name"]) - 5 == 256
    opened = [s for s in spans if s["name"].startswith("open ")]
    assert len(opened) == 5
    assert {s["name"] for s in opened} == {"open /data/caf\ufffd.csv"}
    assert all(len(s["attributes"]["big"]) == len(MEGABYTE) for s in opened)
    marked = [s for s in spans if s["name"] == "task mark"]
    assert {s["attributes"]["user.file"] for s in marked} == {"/data/caf\ufffd.csv"}
    bodies = [str(r["body"]) for r in receiver.log_records()]
    assert "reading /data/caf\ufffd.csv" in bodies

    # Metric labels: the NUL and megabyte keys' prefixes arrive (capped) beside the others.
    capped = "m" * 255 + "\u2026"

    def labelled(r):
        prefixes = {
            (p["name"], p["attributes"].get("dask.task.prefix"))
            for p in r.metrics()
            if p["name"] in ("dask.task.duration", "dask.task.compute.time")
        }
        return {
            (name, prefix)
            for name in ("dask.task.duration", "dask.task.compute.time")
            for prefix in ("inc", "nul\x00", capped)
        } <= prefixes

    assert receiver.wait_for(labelled, timeout=30)

    def no_export_failed(r):
        points = [
            m
            for m in r.metrics("dask_otel.exporter.dropped")
            if m["resource"].get("service.name") == "dask-worker"
        ]
        return points and all(p["value"] == 0 for p in points)

    assert receiver.wait_for(no_export_failed, timeout=30)
