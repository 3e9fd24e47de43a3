"""Pacing for dask-otel's background threads: the GIL goes back to Dask's event loop often.

CPython hands the GIL to a thread that asks for it when the holder blocks, or else only
after the switch interval (5 ms). A worker's event loop is idle most of the time, waiting
for the next message; a background thread that works through a backlog (spans to build,
a batch to encode) in one go holds the GIL when that message arrives, and the loop waits
for the rest of the thread's slice on the path from one task to the next. A real sleep
after each short slice (``sleep(0)`` hands nothing over) bounds that wait to about a
slice. Measured by ``benchmarks/pacing.py``: an event loop's round trips with a thread
doing span-like work beside it take 7% longer with 1 ms slices, 3% with 50 us ones.
"""

from __future__ import annotations

from time import perf_counter, sleep

#: Seconds of work between two pauses, and the pause.
SLICE = 0.00005
PAUSE = 0.0001


class Pacer:
    """Call :meth:`tick` between units of work: it pauses once a slice of work is done."""

    __slots__ = ("_pause_at",)

    def __init__(self) -> None:
        self._pause_at = perf_counter() + SLICE

    def tick(self) -> None:
        if perf_counter() > self._pause_at:
            sleep(PAUSE)
            self._pause_at = perf_counter() + SLICE
