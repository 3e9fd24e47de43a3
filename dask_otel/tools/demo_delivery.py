"""Whether the telemetry of ``dask-otel demo`` got out: each of its processes flushes,
then says what its exporters lost and, if the flush did not finish, what they still hold.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from distributed import Client

from dask_otel import runtime
from dask_otel.export.drops import NOUNS

#: Longest wait for the processes' telemetry before the demo calls it lost, and the
#: ``otel.flush-timeout`` of its cluster's processes (unless set): what the demo makes is
#: exported in well under a second when the collector answers.
FLUSH_TIMEOUT = 3.0


#: What one process says of its exports: whether its flush finished, what its exporters
#: lost by (signal, reason), and the spans and log records they still hold by signal.
Report = tuple[bool, dict[tuple[str, str], int], dict[str, int]]


def flush_and_count() -> Report:
    """In one process: export what it holds (bounded), then say how that went."""
    from dask_otel.export import queues

    finished = runtime.flush(runtime.current(), FLUSH_TIMEOUT)
    held, dropped = queues.unexported()
    return finished, dropped, dict(held)


async def flush_and_count_off_loop() -> Report:
    """:func:`flush_and_count` for ``client.run``: never blocks the server's event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, flush_and_count)


@dataclass
class Delivery:
    """What every process of the demo says about its exports."""

    #: Processes whose flush did not finish in time.
    stalled: int = 0
    #: Items lost, by (signal, reason).
    lost: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Items the stalled processes still held, by signal: lost when the demo ends them.
    held: Counter[str] = field(default_factory=Counter)

    def add(
        self, finished: bool, dropped: dict[tuple[str, str], int], held: dict[str, int]
    ) -> None:
        self.stalled += not finished
        self.lost.update(dropped)
        if not finished:
            self.held.update(held)

    @property
    def failed(self) -> bool:
        return bool(self.stalled or any(self.lost.values()))

    def describe(self) -> str:
        lost = ", ".join(
            f"{count} {NOUNS.get(signal, signal)} ({reason.replace('_', ' ')})"
            for (signal, reason), count in sorted(self.lost.items())
            if count
        )
        parts = [f"lost: {lost}"] if lost else []
        if self.stalled:
            held = ", ".join(
                f"{count} {noun}" for signal, noun in NOUNS.items() if (count := self.held[signal])
            )
            parts.append(
                f"{self.stalled} process(es) could not finish exporting within "
                f"{FLUSH_TIMEOUT:.0f} s: what they still held "
                f"({held or 'no spans or log records'}) is lost too"
            )
        return "; ".join(parts)


def flush_everywhere(client: Client) -> Delivery:
    """Every process flushes at once (this one, the scheduler's, the workers')."""
    with ThreadPoolExecutor(3) as pool:
        here = pool.submit(flush_and_count)
        scheduler = pool.submit(client.run_on_scheduler, flush_and_count_off_loop)
        workers = pool.submit(client.run, flush_and_count_off_loop)
        reports = [here.result(), scheduler.result(), *workers.result().values()]
    delivery = Delivery()
    for finished, dropped, held in reports:
        delivery.add(finished, dropped, held)
    return delivery
