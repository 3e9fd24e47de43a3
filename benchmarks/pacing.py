"""What a background thread's slices of work cost an event loop that waits for messages.

A worker's event loop is idle most of the time, waiting for the next message; dask-otel's
span emitter works beside it on the same GIL. Here an event loop makes round trips to an
echo server in another process that answers after ``--server-us`` of work (the rest of
the cluster), and does ``--loop-us`` of work on each answer (Dask's handlers), while
dask-otel's real :class:`~dask_otel.spans.emitter.SpanEmitter` gets ``--emit-us`` of
span-like work per round trip, pausing after each ``--slices`` value of work in turn (its
``SLICE``; 1 ms in the package). Modes interleave, rotating which goes first; reported:
time per round trip and its ratio to the rounds without an emitter, median (min-max).

    python benchmarks/pacing.py --rounds 11
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from typing import Any

import overhead

from dask_otel.spans import emitter as emitter_module
from dask_otel.spans.emitter import SpanEmitter

ECHO_SERVER = """
import asyncio, sys, time

async def answer(reader, writer):
    while data := await reader.read(100):
        end = time.perf_counter() + float(sys.argv[1])
        while time.perf_counter() < end:
            pass
        writer.write(data)
        await writer.drain()

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


def busy(seconds: float) -> None:
    """Pure-Python work holding the GIL, as building a span does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def round_trips(port: int, count: int, loop_s: float, emit_s: float, emitter: Any) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.perf_counter()
    for _ in range(count):
        writer.write(b"x" * 50)
        await writer.drain()
        await reader.readexactly(50)
        busy(loop_s)
        if emitter is not None:
            emitter.submit(busy, emit_s)
    elapsed = time.perf_counter() - started
    writer.close()
    await writer.wait_closed()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--trips", type=int, default=4000)
    parser.add_argument("--server-us", type=float, default=500)
    parser.add_argument("--loop-us", type=float, default=300)
    parser.add_argument("--emit-us", type=float, default=60)
    parser.add_argument("--slices", default="0.001,0.0002,0.00005", help="seconds, comma-separated")
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, str(args.server_us * 1e-6)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]

        def run(mode: str) -> float:
            emitter = None
            if mode != "none":
                emitter_module.SLICE = float(mode)
                emitter = SpanEmitter("benchmark-pacing")
            elapsed = asyncio.run(
                round_trips(port, args.trips, args.loop_us * 1e-6, args.emit_us * 1e-6, emitter)
            )
            if emitter is not None:
                emitter.close(10)
            return elapsed

        modes = ["none", *args.slices.split(",")]
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        for times in overhead.interleaved(modes, args.rounds, run):
            for mode, elapsed in times.items():
                results[mode].append(elapsed)
    finally:
        server.kill()
        server.wait()
    print(
        f"{args.trips} round trips per round, {args.rounds} interleaved rounds; server "
        f"{args.server_us:g} us, loop {args.loop_us:g} us, emitter {args.emit_us:g} us per trip"
    )
    for mode in modes:
        ratios = [a / b for a, b in zip(results[mode], results["none"], strict=True)]
        label = "no emitter" if mode == "none" else f"slices of {float(mode) * 1e6:g} us"
        print(
            f"  {label:<20} {1e6 * statistics.median(results[mode]) / args.trips:7.1f} us per "
            f"trip, ratio {overhead.median_range(ratios)}"
        )


if __name__ == "__main__":
    main()
