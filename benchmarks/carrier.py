"""CPU per task of keeping the trace context off users' annotations (the carrier path).

The scheduler keeps each task's carrier by key and adds it to a copy of the task's
annotations in the ``compute-task`` message only; the worker takes it out again before
Dask reads the message and keeps it by ``TaskState``. This times those steps for every
task of a real graph: an instrumented in-process cluster computes and keeps ``--tasks``
tasks (half leaves, half a tree summing them, as ``overhead.py --workload graph``), then,
in interleaved rounds, each task's ``compute-task`` message is built by Dask's own
``Scheduler._task_to_msg`` and by dask-otel's, and the worker's side runs on the messages
dask-otel built. Median over the rounds, with min-max, in this thread alone.

    python benchmarks/carrier.py --tasks 4000 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import dask
from distributed import Client, LocalCluster, wait
from opentelemetry.sdk.trace import TracerProvider

import dask_otel
from dask_otel.spans import ids


def graph(tasks: int) -> Any:
    """``tasks`` tasks: half leaves, half a binary tree summing them."""
    leaves = [
        dask.delayed(lambda i: i, pure=True)(i, dask_key_name=f"leaf-{i}")
        for i in range(tasks // 2)
    ]
    level = 0
    while len(leaves) > 1:
        leaves = [
            dask.delayed(sum, pure=True)(leaves[i : i + 2], dask_key_name=f"sum-{level}-{i}")
            for i in range(0, len(leaves), 2)
        ]
        level += 1
    return leaves[0]


def per_task(step: Callable[[Any], Any], items: list[Any]) -> float:
    """CPU microseconds per item of ``step`` over ``items``."""
    start = time.thread_time_ns()
    for item in items:
        step(item)
    return (time.thread_time_ns() - start) / 1e3 / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    dask_otel.DaskInstrumentor().instrument(tracer_provider=TracerProvider())
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster) as client,
    ):
        result = client.persist(graph(args.tasks))
        wait(result)
        scheduler = cluster.scheduler
        tasks = [ts for ts in scheduler.tasks.values() if ts.run_spec is not None]
        plain = type(scheduler)._task_to_msg.__get__(scheduler)
        traced = scheduler._task_to_msg  # dask-otel's
        annotations = [traced(ts)["annotations"] for ts in tasks]
        carried = sum(ids.ANNOTATION in a for a in annotations)
        carriers = ids.TaskCarriers()
        worker_tasks = list(cluster.workers[0].state.tasks.values())[: len(tasks)]

        def worker_side(i: int) -> None:
            _, carrier = ids.take_carrier(annotations[i])
            carriers.set(worker_tasks[i % len(worker_tasks)], carrier)

        indices = list(range(len(tasks)))
        results: dict[str, list[float]] = {"plain": [], "dask-otel": [], "worker": []}
        for r in range(args.rounds):
            steps = [("plain", plain, tasks), ("dask-otel", traced, tasks)]
            for name, step, items in steps if r % 2 == 0 else steps[::-1]:
                results[name].append(per_task(step, items))
            results["worker"].append(per_task(worker_side, indices))
    dask_otel.DaskInstrumentor().uninstrument()

    def line(name: str) -> str:
        values = results[name]
        return f"{statistics.median(values):.2f} us ({min(values):.2f}-{max(values):.2f})"

    extra = [t - p for t, p in zip(results["dask-otel"], results["plain"], strict=True)]
    print(f"{len(tasks)} tasks ({carried} with a carrier), {args.rounds} interleaved rounds")
    print(f"scheduler, compute-task message, Dask's own:      {line('plain')}")
    print(f"scheduler, compute-task message, with the carrier: {line('dask-otel')}")
    print(
        f"scheduler, added per task: median {statistics.median(extra):.2f} us "
        f"({min(extra):.2f}-{max(extra):.2f})"
    )
    print(f"worker, carrier taken out and kept per task:       {line('worker')}")


if __name__ == "__main__":
    main()
