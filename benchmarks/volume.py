"""Span volume: does every span of a 100,000-task computation reach the collector?

Runs N no-op tasks (``client.map``) with EVERY task traced (``otel.task.max-spans-per-graph``
raised to N, sample ratio 1) on an in-process ``LocalCluster(n_workers=2,
threads_per_worker=1, processes=False)``. The SDK is set up by dask-otel itself
(``dask_otel.instrument()``: the configurator ``opentelemetry-instrument`` runs, reading
the ``OTEL_*`` variables), exporting over OTLP/gRPC to a receiver in another process
(``tests/otlp_receiver.py``'s servers, with its default 4 MiB gRPC message limit, the
same as the collector's). The receiver counts spans per name; the benchmark compares
them with what the computation must produce: one ``compute``, one ``graph`` and N
``task`` spans (with ``--fail``: N ``attempt`` spans from the workers and N ``task``
spans from the scheduler, all carrying an exception).

In-process workers are deliberate: the spans of the scheduler and of both workers all go
through ONE batch span processor and exporter, twice the span rate a worker process
would see, so a queue or message limit that is too small shows here first.

    python benchmarks/volume.py --tasks 100000
    python benchmarks/volume.py --tasks 100000 --env OTEL_BSP_MAX_QUEUE_SIZE=2048  # SDK default
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


class Receiver:
    """The receiver process: ``state()`` asks for its counts, ``reset()`` zeroes them."""

    def __init__(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from otlp_receiver import spawn_counting

        self.endpoint, self.proc = spawn_counting()
        if not self.endpoint.startswith("http://"):
            raise RuntimeError("the OTLP receiver did not start")

    def _ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def state(self) -> dict:
        return self._ask("state")

    def reset(self) -> dict:
        return self._ask("reset")

    def settle(self, expected: int, timeout: float) -> dict:
        """Wait until ``expected`` spans arrived, or nothing arrived for 5 s."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            total = sum(state["spans"].values())
            idle = state["idle"]
            if total >= expected or time.monotonic() > deadline or (idle or 0) > 5:
                return state
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.communicate("")


def noop(i: int) -> int:
    return i


def fail(i: int, depth: int = 10) -> int:
    """Raises 10 calls deep: erred tasks carry the exception and its stack on two spans
    (the worker's attempt, the scheduler's task)."""
    if depth:
        return fail(i, depth - 1)
    raise ValueError(f"task {i} failed: " + "the input was not what this code expected " * 12)


def flush_scheduler(dask_scheduler) -> bool:  # type: ignore[no-untyped-def]
    plugin = dask_scheduler.plugins.get("dask-otel")
    return plugin is None or plugin.flush(300)


def emitter_backlog(dask_scheduler) -> int:  # type: ignore[no-untyped-def]
    """Task records the scheduler has yet to turn into spans."""
    from dask_otel.spans import emitter

    plugin = dask_scheduler.plugins.get("dask-otel")
    return emitter.shared().backlog if plugin is not None and plugin.settings else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="OTEL_* setting for the traced process, e.g. OTEL_BSP_MAX_QUEUE_SIZE=2048",
    )
    parser.add_argument(
        "--fail", action="store_true", help="every task raises (spans carry exceptions)"
    )
    parser.add_argument(
        "--close-at-once",
        action="store_true",
        help="close the cluster as soon as the results are in (the scheduler's flush on"
        " close, bounded by otel.flush-timeout, is all the spans get)",
    )
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING)  # dask-otel's warnings about lost spans
    receiver = Receiver()
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRICS_EXPORTER="none",
    )
    os.environ.update(item.split("=", 1) for item in args.env)

    import dask
    from distributed import Client, LocalCluster, wait
    from opentelemetry import _logs, trace

    import dask_otel
    from dask_otel.distro import sdk

    dask.config.set(
        {
            "otel.task.max-spans-per-graph": max(args.tasks, 10_000),
            "otel.task.sample-ratio": 1.0,
            "distributed.diagnostics.nvml": False,
        }
    )
    dask_otel.instrument()  # configures the SDK from OTEL_* as opentelemetry-instrument does
    provider = trace.get_tracer_provider()
    settings = {n: os.environ.get(n) for n in sorted(os.environ) if n.startswith("OTEL_B")}

    try:
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster) as client,
        ):
            client.gather(client.map(noop, range(100), pure=False))  # warm up
            client.run_on_scheduler(flush_scheduler)
            provider.force_flush()  # type: ignore[attr-defined]
            receiver.settle(100 + 2, timeout=30)
            receiver.reset()
            dropped_before = dict(getattr(sdk, "dropped", lambda: {})())

            start = time.perf_counter()
            futures = client.map(fail if args.fail else noop, range(args.tasks), pure=False)
            wait(futures)
            computed = time.perf_counter() - start
            del futures
            if not args.close_at_once:
                client.run_on_scheduler(flush_scheduler)
            backlog = client.run_on_scheduler(emitter_backlog)
            emitted = time.perf_counter() - start
        provider.force_flush()  # type: ignore[attr-defined]
        flushed = time.perf_counter() - start
        _logs.get_logger_provider().force_flush()  # type: ignore[attr-defined]
        expected = {"compute": 1, "graph": 1, "task": args.tasks}
        if args.fail:  # each attempt's span from its worker, each task's from the scheduler
            expected["attempt"] = args.tasks
        state = receiver.settle(sum(expected.values()), timeout=120)
        dropped_after = dict(getattr(sdk, "dropped", lambda: {})())
    finally:
        receiver.close()

    received = state["spans"]
    kind = "failing" if args.fail else "no-op"
    print(f"\n{args.tasks} {kind} tasks, every task traced, OTLP/gRPC to 127.0.0.1")
    print("settings: " + " ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"{'span':<10} {'expected':>9} {'received':>9} {'dropped':>8}")
    for name, count in expected.items():
        got = received.get(name, 0)
        print(f"{name:<10} {count:>9} {got:>9} {count - got:>8}")
    total_expected = sum(expected.values())
    total_received = sum(received.get(name, 0) for name in expected)
    total_dropped = total_expected - total_received
    print(f"{'total':<10} {total_expected:>9} {total_received:>9} {total_dropped:>8}")
    others = {k: v for k, v in received.items() if k not in expected}
    if others:
        print(f"other spans received: {others}")
    print(
        f"wall: results in {computed:.1f}s ({1e3 * computed / args.tasks:.2f} ms/task),"
        f" released and spans built at {emitted:.1f}s (records left for the scheduler's"
        f" close: {backlog}), all exported at {flushed:.1f}s"
    )
    seconds = state["seconds"]
    spans = sum(received.values())
    if seconds:
        print(
            f"export: {spans} spans in {state['requests']} requests over {seconds:.1f}s"
            f" = {spans / seconds:,.0f} spans/s while exporting"
        )
    print(f"log records received: {state['log_records']}")
    if spans:
        print(
            f"requests: {state['bytes'] / spans:.0f} B/span on the wire, largest request"
            f" {state['max_request'] / 2**20:.2f} MiB (gRPC's and the collector's default"
            " limit: 4 MiB)"
        )
    lost = {k: v - dropped_before.get(k, 0) for k, v in dropped_after.items()}
    print(f"dask-otel drop counter (dask_otel.exporter.dropped) during the run: {lost or 0}")


if __name__ == "__main__":
    main()
