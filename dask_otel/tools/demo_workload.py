"""What ``dask-otel demo`` runs: plain Python functions as Dask tasks, in four steps.

A reduction that moves data between workers, a persist that spills to disk and is read
back, tasks that log, and a task that fails twice (``retries=1``). Needs nothing but
dask-otel's own dependencies (no numpy).
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import dataclass
from typing import Any, TextIO

from dask import delayed
from distributed import Client


@dataclass(frozen=True)
class Size:
    """One workload size."""

    #: Blocks concatenated pairwise up a tree, then averaged: the data moves between workers.
    blocks: int
    block_bytes: int
    #: Blocks persisted: more than the workers' spill targets hold together.
    persisted: int
    persisted_bytes: int
    #: Memory limit per worker; it spills past 30% of it (its spill target).
    memory_limit: int


SIZES = {
    "normal": Size(16, 1_000_000, persisted=64, persisted_bytes=2**20, memory_limit=64 * 2**20),
    "small": Size(8, 250_000, persisted=32, persisted_bytes=2**20, memory_limit=32 * 2**20),
}


def random_block(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def concat(left: bytes, right: bytes) -> bytes:
    return left + right


def mean(data: bytes) -> float:
    return sum(data) / len(data)


def checksum(crcs: list[int]) -> int:
    return sum(crcs) % 2**32


def log_and_square(x: int) -> int:
    import logging

    logging.getLogger("dask_otel.tools.demo.task").warning("squaring %d inside a task", x)
    return x * x


def fail_always(x: int) -> int:
    raise ValueError(f"demo failure on input {x}")


def _tree(blocks: list[Any]) -> Any:
    """Concatenate ``blocks`` pairwise, level by level, into one."""
    while len(blocks) > 1:
        pairs = [delayed(concat)(a, b) for a, b in zip(blocks[::2], blocks[1::2], strict=False)]
        blocks = pairs + blocks[len(pairs) * 2 :]
    return blocks[0]


class Steps:
    """Prints each step of the demo and how long it took."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._started = 0.0

    def start(self, text: str) -> None:
        self._out.write(f"  {text} ...")
        self._out.flush()
        self._started = time.perf_counter()

    def done(self, detail: str = "") -> None:
        self._out.write(f" done in {time.perf_counter() - self._started:.1f} s{detail}\n")
        self._out.flush()


def compute(client: Client, size: Size, steps: Steps) -> None:
    """The demo's four steps, on the cluster behind ``client``."""
    megabytes = size.blocks * size.block_bytes / 1e6
    steps.start(f"a reduction of {megabytes:.0f} MB in {size.blocks} blocks across workers")
    blocks = [delayed(random_block)(i, size.block_bytes) for i in range(size.blocks)]
    average = delayed(mean)(_tree(blocks)).compute()
    steps.done(f" (mean byte {average:.2f})")

    stored = size.persisted * size.persisted_bytes / 2**20
    steps.start(f"persisting {stored:.0f} MiB, more than the workers keep in memory")
    seeds = range(1000, 1000 + size.persisted)
    persisted = client.persist([delayed(random_block)(i, size.persisted_bytes) for i in seeds])
    total = delayed(checksum)([delayed(zlib.crc32)(b) for b in persisted]).compute()
    del persisted
    steps.done(f" (checksum {total})")

    steps.start("tasks that log")
    squares = client.gather(client.map(log_and_square, range(4)))
    steps.done(f" ({squares})")

    steps.start("a task that fails, with one retry")
    try:
        client.submit(fail_always, 42, retries=1).result()
    except ValueError as e:
        steps.done(f" (failed as planned: {e})")
