"""What a ``compute`` span's wait for its results costs the client's event loop.

The span ends once every future it asked for is ready (``dask_otel.plugins.client``): one
coroutine on the client's loop goes through the futures' states. Here ``--tasks`` no-op
futures of an in-process cluster are gathered, then the wait runs over their states (all
done, as most are when the first pending one completes), timed on the client's loop
against Dask's own ``FutureState.wait`` for each, in interleaved rounds.

    python benchmarks/compute_wait.py --tasks 4000 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from distributed import Client, LocalCluster
from opentelemetry.trace import INVALID_SPAN

from dask_otel.plugins import client as otel_client


async def each_awaited(states: list[Any]) -> None:
    for state in states:
        await state.wait()


async def timed(wait: Any, states: list[Any]) -> float:
    started = time.perf_counter()
    await wait(states)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    waits = {
        "every state awaited": each_awaited,
        "dask-otel's wait": lambda states: otel_client._end_after(states, INVALID_SPAN),
    }
    results: dict[str, list[float]] = {name: [] for name in waits}
    cluster = LocalCluster(n_workers=2, processes=False, dashboard_address=None)
    with cluster, Client(cluster) as client:
        futures = client.map(lambda i: i, range(args.tasks), pure=False)
        client.gather(futures)
        states = [client.futures[f.key] for f in futures]
        names = list(waits)
        for r in range(args.rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                results[name].append(client.sync(timed, waits[name], states))
    for name, values in results.items():
        per_task = [v / args.tasks * 1e6 for v in values]
        print(
            f"{name}: median {statistics.median(per_task):.2f} us per future "
            f"(min {min(per_task):.2f}, max {max(per_task):.2f}), {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
