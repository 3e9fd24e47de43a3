"""dask-otel keeps no per-task state once a computation is over (benchmarks/memory.py
measures the bytes; this checks the state, without timing anything)."""

from __future__ import annotations

import asyncio
import time

from conftest import flush_emitters, in_process_cluster
from distributed import Event, wait

from dask_otel.spans import emitter


def blocked(name: str) -> None:
    Event(name).wait()


def inc(x: int) -> int:
    return x + 1


def boom(x: int) -> int:
    raise ValueError(x)


async def plugin_state(dask_scheduler) -> dict[str, int]:
    plugin = dask_scheduler.plugins["dask-otel"]
    await asyncio.sleep(0)  # the event of this very call, noted just before it, leaves
    assert await asyncio.to_thread(plugin.flush, 10)  # and is exported
    return {
        "tasks on the scheduler": len(dask_scheduler.tasks),
        **plugin.held(),
        "emitter backlog": emitter.shared().backlog,
    }


def released(client) -> dict[str, int]:
    """The plugin's state once it is empty (releases and events are asynchronous), or
    after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        flush_emitters(client)
        state = client.run_on_scheduler(plugin_state)
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def independent(client, i: int) -> None:
    futures = client.map(inc, range(200), pure=False)
    assert sum(client.gather(futures)) == sum(range(1, 201))


def dependent(client, i: int) -> None:  # transfers between the two workers
    parts = client.map(inc, range(50), pure=False)
    assert client.submit(sum, parts, pure=False).result() == sum(range(1, 51))


def erred(client, i: int) -> None:  # a failed task and its erred dependents
    bad = client.submit(boom, 1, pure=False)
    futures = [bad, *client.map(inc, [bad] * 5, pure=False)]
    wait(futures)
    assert {f.status for f in futures} == {"error"}


def cancelled(client, i: int) -> None:  # waiting tasks cancelled before they ran
    gate = client.submit(blocked, f"gate-{i}", pure=False)
    waiting = client.map(inc, [gate] * 20, pure=False)
    client.cancel([*waiting, gate])
    Event(f"gate-{i}", client=client).set()


def test_no_state_left_after_ten_computations(telemetry):
    kinds = [independent, dependent, erred, cancelled]
    with in_process_cluster() as client:
        for i in range(10):
            kinds[i % len(kinds)](client, i)  # its futures are released on return
            state = released(client)
            assert state == dict.fromkeys(state, 0), (i, state)
    assert telemetry.spans("task ")
