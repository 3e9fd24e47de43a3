"""Nanny restarts, plain and under ``opentelemetry-instrument``.

distributed's tests restart Nanny workers (``await c.restart()``) inside 30 s deadlines,
and give a Nanny's start 5 s (``death_timeout``) in deploy/tests/test_subprocess.py: a
slower worker start under instrumentation shows there first. Each round runs, once plain
and once instrumented (traces, metrics and logs over OTLP/gRPC to the tests' receiver in
another process), alternating which goes first, a process that starts a scheduler and two
Nannies, then restarts them ``--restarts`` times, timing each ``c.restart()`` and the two
halves of each Nanny's part in it: ``Nanny.kill`` (the old worker's close, dask-otel's
flush in its teardown included) and ``Nanny.instantiate`` (the new worker process's start
until it is up: interpreter, ``opentelemetry-instrument``'s start-up, imports, plugins,
registration). Prints each one's median with min-max per mode.

    python benchmarks/nanny_restart.py --rounds 7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import start_receiver
from startup import environment, spread

PROGRAM = """
import asyncio, json, sys, time

from distributed import Client, Nanny, Scheduler
from distributed.utils_test import inc

timings = {"kill": [], "instantiate": []}

def timed(name, fn):
    async def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await fn(self, *args, **kwargs)
        finally:
            timings[name].append(time.perf_counter() - started)
    return wrapper

Nanny.kill = timed("kill", Nanny.kill)
Nanny.instantiate = timed("instantiate", Nanny.instantiate)

async def main(restarts):
    started = time.perf_counter()
    async with Scheduler(port=0, host="127.0.0.1", dashboard_address=":0") as s:
        async with Nanny(s.address, nthreads=1, host="127.0.0.1"), Nanny(
            s.address, nthreads=2, host="127.0.0.1"
        ):
            up = time.perf_counter() - started
            del timings["instantiate"][:]  # the first start is not a restart's
            async with Client(s.address, asynchronous=True) as c:
                took = []
                for _ in range(restarts):
                    await c.gather(c.map(inc, range(10)))
                    t = time.perf_counter()
                    await c.restart()
                    took.append(time.perf_counter() - t)
                restarts = {name: list(values) for name, values in timings.items()}
    print(json.dumps({"up": [up], "restart": took, **restarts}), flush=True)

asyncio.run(main(int(sys.argv[1])))
"""

#: What each round measures, as the table names it.
ROWS = {
    "restart": "c.restart()",
    "kill": "Nanny.kill in a restart",
    "instantiate": "Nanny.instantiate in a restart",
    "up": "scheduler and two Nannies up",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--restarts", type=int, default=3, help="per process")
    args = parser.parse_args()
    instrument = str(Path(sys.executable).with_name("opentelemetry-instrument"))
    endpoint, receiver = start_receiver()
    env = environment(endpoint)
    program = [sys.executable, "-c", PROGRAM, str(args.restarts)]
    commands = {"plain": program, "instrumented": [instrument, *program]}
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in commands}
    try:
        with tempfile.TemporaryDirectory() as cwd:
            for i in range(args.rounds):
                for mode in list(commands)[:: 1 if i % 2 == 0 else -1]:
                    out = subprocess.run(
                        commands[mode], env=env, cwd=cwd, capture_output=True, text=True,
                        check=True, timeout=600,
                    )  # fmt: skip
                    for name, values in json.loads(out.stdout.splitlines()[-1]).items():
                        times[mode].setdefault(name, []).extend(values)
    finally:
        receiver.communicate("")
    print(f"{args.rounds} rounds of {args.restarts} restarts: seconds, median (min-max)")
    print("| | plain | instrumented |\n|---|---|---|")
    for name, label in ROWS.items():
        counts = len(times["plain"][name])
        cells = " | ".join(spread(times[mode][name]) for mode in commands)
        print(f"| {label} ({counts}) | {cells} |")


if __name__ == "__main__":
    main()
