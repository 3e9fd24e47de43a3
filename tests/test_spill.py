"""``spill``/``unspill`` spans: a worker moving data to disk and back, in the producer's trace.

One in-process worker whose spill buffer target is a few MiB; process-memory thresholds
are off (the test process is the worker's process), so spilling is the buffer's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dask
import numpy as np
from conftest import flush_emitters, in_process_cluster
from distributed import Client, wait
from opentelemetry.trace import StatusCode

MiB = 2**20

#: A 10 MiB worker whose spill buffer keeps 60% of it (``target``, 6 MiB) in memory.
MEMORY = {
    "distributed.worker.memory.target": 0.6,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}


def block(i: int) -> np.ndarray:
    return np.full(2 * MiB // 8, float(i))


def total(b: np.ndarray) -> float:
    return float(b.sum())


class Unpicklable:
    """Large by ``sizeof`` and impossible to pickle: spilling it must fail."""

    def __sizeof__(self) -> int:
        return 3 * MiB

    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def unpicklable(i: int) -> Unpicklable:
    return Unpicklable()


def evict(dask_worker) -> int:
    return dask_worker.data.evict()


@contextmanager
def spill_cluster() -> Iterator[Client]:
    with dask.config.set(MEMORY), in_process_cluster(n_workers=1, memory_limit=10 * MiB) as c:
        yield c


def task_span_ids(spans) -> dict[str, tuple[int, int]]:
    return {
        s.attributes["dask.task.key"]: (s.context.trace_id, s.context.span_id)
        for s in spans
        if s.name.startswith("task ")
    }


def test_spill_and_unspill_root_traces_linked_to_the_producer(telemetry):
    with spill_cluster() as client:
        blocks = client.map(block, range(6))
        wait(blocks)  # all written before any is read: the oldest are on disk by now
        # Reading every block back: the spilled ones come back from disk.
        assert client.gather(client.map(total, blocks)) == [i * 2 * MiB / 8 for i in range(6)]
        # One more key to disk on request: reason "explicit".
        (evicted,) = client.run(evict).values()
        assert evicted >= 2 * MiB
        flush_emitters(client)

    spans = telemetry.spans()
    tasks = task_span_ids(spans)
    spilled = [s for s in spans if s.name == "spill block"]
    unspilled = [s for s in spans if s.name == "unspill block"]
    # 6 blocks of 2 MiB against a 6 MiB target: the oldest go to disk, and come back for
    # the sum.
    assert len(spilled) >= 2 and len(unspilled) >= 1
    for span in spilled + unspilled:
        key = span.attributes["dask.task.key"]
        # After the producer's span ended: a trace of its own, linked to that span.
        assert span.parent is None
        assert span.context.trace_id != tasks[key][0]
        (link,) = span.links
        assert (link.context.trace_id, link.context.span_id) == tasks[key]
        assert link.attributes == {"dask.link": "result"}
        assert span.attributes["dask.task.prefix"] == "block"
        assert span.attributes["dask.spill.bytes"] >= 2 * MiB
        assert 0 < span.attributes["dask.spill.disk_bytes"] <= 3 * MiB
        assert span.status.status_code == StatusCode.UNSET
        assert span.end_time >= span.start_time
    reasons = [s.attributes["dask.spill.reason"] for s in spilled]
    assert "target" in reasons and reasons[-1] == "explicit", reasons
    assert all("dask.spill.reason" not in s.attributes for s in unspilled)


def test_a_failed_spill_is_an_error_span_and_changes_nothing(telemetry):
    with spill_cluster() as client:
        objects = client.map(unpicklable, range(3))
        # Dask keeps what it cannot pickle in memory: the computation is unaffected.
        assert client.submit(len, objects).result() == 3
        flush_emitters(client)

    failed = [s for s in telemetry.spans() if s.name == "spill unpicklable"]
    assert failed
    for span in failed:
        assert span.status.status_code == StatusCode.ERROR
        (event,) = [e for e in span.events if e.name == "exception"]
        assert "Unpicklable" in event.attributes["exception.message"]
        assert "dask.spill.disk_bytes" not in span.attributes


def test_untraced_tasks_spill_without_spans(telemetry):
    with (
        dask.config.set({"otel.task.exclude-prefixes": ["block", "total"]}),
        spill_cluster() as client,
    ):
        blocks = client.map(block, range(6))
        assert len(client.gather(client.map(total, blocks))) == 6
        spilled = client.run(lambda dask_worker: len(dask_worker.data.slow))
        flush_emitters(client)
    assert next(iter(spilled.values())) >= 1
    assert not [s for s in telemetry.spans() if "spill" in s.name]


def test_spill_spans_switched_off(telemetry):
    with dask.config.set({"otel.spans.spill": False}), spill_cluster() as client:
        blocks = client.map(block, range(6))
        assert len(client.gather(client.map(total, blocks))) == 6
        flush_emitters(client)
    assert telemetry.spans("task block")
    assert not [s for s in telemetry.spans() if "spill" in s.name]
