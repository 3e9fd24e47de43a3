"""Memory kept by a process that runs short-lived clusters one after another.

A notebook or a test suite makes cluster after cluster in one process. Each run here makes
``--clusters`` in-process ``LocalCluster(n_workers=2, threads_per_worker=1,
processes=False)`` in turn, runs 500 tasks on each and closes it, in a process of its own:
plain, then instrumented (``DaskInstrumentor`` with the user's own SDK providers: a batch
span processor and a periodic metric reader, both exporting to nowhere). After each
cluster: RSS, and the bytes ``tracemalloc`` traces as allocated and still alive. Reported:
the growth per cluster from the 5th cluster to the last (Dask keeps some state of every
closed cluster, instrumented or not), and for the instrumented run the growth in
allocations made by ``dask_otel`` and ``opentelemetry`` code.

    python benchmarks/cluster_memory.py --clusters 12
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tracemalloc

FIRST = 4  # the cluster after which growth is measured: Dask's start-up is behind it


def inc(x: int) -> int:
    return x + 1


def one_run(instrumented: bool, clusters: int) -> dict[str, float]:
    import psutil
    from distributed import Client, LocalCluster

    if instrumented:
        _instrument()
    tracemalloc.start(1)
    rss, traced, ours = [], [], []
    for _ in range(clusters):
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
            ) as cluster,
            Client(cluster) as client,
        ):
            client.gather(client.map(inc, range(500)))
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)
        traced.append(tracemalloc.get_traced_memory()[0])
        ours.append(_otel_bytes(tracemalloc.take_snapshot()))
    spread = clusters - 1 - FIRST
    return {
        "rss": (rss[-1] - rss[FIRST]) / spread,
        "traced": (traced[-1] - traced[FIRST]) / spread,
        "otel": (ours[-1] - ours[FIRST]) / spread,
    }


def _instrument() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from overhead import DiscardingExporter, DiscardingMetricExporter

    import dask_otel

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DiscardingExporter()))
    reader = PeriodicExportingMetricReader(DiscardingMetricExporter(), export_interval_millis=1000)
    dask_otel.DaskInstrumentor().instrument(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )


def _otel_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes still allocated by dask-otel's and OpenTelemetry's code."""
    ours = snapshot.filter_traces(
        [tracemalloc.Filter(True, "*dask_otel*"), tracemalloc.Filter(True, "*opentelemetry*")]
    )
    return sum(stat.size for stat in ours.statistics("filename"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=12)
    parser.add_argument("--run", choices=["plain", "instrumented"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clusters <= FIRST + 1:
        parser.error(f"--clusters must be more than {FIRST + 1}")
    if args.run:
        print(json.dumps(one_run(args.run == "instrumented", args.clusters)))
        return
    kb = 1024
    results = {}
    for mode in ("plain", "instrumented"):
        command = [sys.executable, __file__, "--clusters", str(args.clusters), "--run", mode]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.clusters} clusters, growth per cluster from cluster {FIRST + 1} on:")
    for mode, found in results.items():
        print(
            f"  {mode:<13} RSS {found['rss'] / kb:8.0f} kB  traced {found['traced'] / kb:8.0f} kB"
            f"  dask-otel and OpenTelemetry code {found['otel'] / kb:6.0f} kB"
        )


if __name__ == "__main__":
    main()
