"""A scheduler preload that times dask-otel's own work on the scheduler's event loop.

``benchmarks/deployed.py --probe`` loads it into the scheduler of every round, plain and
instrumented. It times, with the event-loop thread's CPU clock, each call of the entry
points through which Dask reaches dask-otel's scheduler plugin (``transition``,
``update_graph``, ``log_event``) and Dask's ``compute-task`` message builder, once as Dask
made it and once as the scheduler calls it (with dask-otel's carrier added, when
instrumented). :func:`snapshot`, run on the scheduler, returns the CPU seconds so far by
entry point, net of the probe's own cost per call (measured when it installs), and how
many messages the scheduler's comms read and wrote: more of them per task means more of
Dask's own work per task (smaller batches), which no entry point of dask-otel shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from distributed.comm import tcp
from distributed.comm.tcp import TCP

#: Entry point -> [calls, CPU seconds].
_spent: dict[str, list] = {}
#: The probe's own CPU seconds per call (a timed call of a no-op).
_probe_cost = [0.0]
PLUGIN = "dask-otel"


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.thread_time
    spent = _spent.setdefault(name, [0, 0.0])

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return function(*args, **kwargs)
        finally:
            spent[0] += 1
            spent[1] += clock() - start

    return timed


def _calibrate(calls: int = 200_000) -> float:
    timed = _timed("calibration", lambda *args, **kwargs: None)
    for _ in range(calls):
        timed(1, 2, stimulus_id="x")
    calls, seconds = _spent.pop("calibration")
    return seconds / calls


#: Messages the scheduler's comms read and wrote (each a batch of Dask's messages), and
#: their bytes.
messages = {"comm reads": 0, "comm writes": 0, "bytes read": 0, "bytes written": 0}


def _counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    async def counted(*args: Any, **kwargs: Any) -> Any:
        messages[name] += 1
        return await method(*args, **kwargs)

    return counted


async def _to_frames(*args: Any, **kwargs: Any) -> Any:
    frames = await _original_frames[0](*args, **kwargs)
    messages["bytes written"] += sum(map(len, frames))
    return frames


async def _from_frames(frames: Any, *args: Any, **kwargs: Any) -> Any:
    messages["bytes read"] += sum(map(len, frames))
    return await _original_frames[1](frames, *args, **kwargs)


_original_frames = (tcp.to_frames, tcp.from_frames)


def dask_setup(scheduler: Any) -> None:
    # Before the plugins start: dask-otel's carriers then wrap this, Dask's own builder.
    scheduler._task_to_msg = _timed("compute-task message (Dask)", scheduler._task_to_msg)
    TCP.read = _counted("comm reads", TCP.read)  # type: ignore[method-assign]
    TCP.write = _counted("comm writes", TCP.write)  # type: ignore[method-assign]
    tcp.to_frames, tcp.from_frames = _to_frames, _from_frames


def _install(scheduler: Any) -> None:
    _probe_cost[0] = _calibrate()
    plugin = scheduler.plugins.get(PLUGIN)
    if plugin is None:
        return
    for name in ("transition", "update_graph", "log_event"):
        setattr(plugin, name, _timed(name, getattr(plugin, name)))
    scheduler._task_to_msg = _timed("compute-task message (as sent)", scheduler._task_to_msg)


def snapshot(dask_scheduler: Any) -> dict[str, float]:
    """Net CPU seconds so far by entry point, and the comms' messages (counts). The first
    call (before the workload) installs the timers on dask-otel's plugin, which has
    started by then."""
    if not _probe_cost[0]:
        _install(dask_scheduler)
    cost = _probe_cost[0]
    spent = {name: seconds - calls * cost for name, (calls, seconds) in _spent.items()}
    # The message as sent contains Dask's, and its probe: the carrier's share is the rest.
    outer = spent.pop("compute-task message (as sent)", None)
    if outer is not None:
        calls = _spent["compute-task message (Dask)"][0]
        spent["compute-task carrier"] = outer - spent["compute-task message (Dask)"] - calls * cost
    return {**spent, **messages}
