"""Overhead of dask-otel on Dask's own bottleneck: many tiny tasks, and moving data.

Runs a workload on an in-process ``LocalCluster(n_workers=2, threads_per_worker=1,
processes=False)``, plain and instrumented, in interleaved rounds within one run, and
reports the median of the per-round ratios with min and max, the CPU time per task of each
group of threads (the event loop that the scheduler and both workers share, dask-otel's
span emitters, the SDK's threads) and of garbage collection. The instrumented rounds use
the real SDK with every span sampled (the batch span processor dask-otel configures;
``--processor sdk`` for the SDK's own) and metrics on (a periodic reader collecting every
5 s); spans and metrics go to exporters that discard them (``--export otlp`` sends spans
over OTLP/gRPC to a receiver in another process instead, so the export cost is included).
``--processes`` runs the workers in processes of their own, as a real cluster does (the
scheduler and the client stay here), each configuring the SDK from ``OTEL_*`` variables
and exporting over OTLP; the CPU ratio then counts the worker processes too. Plain and
instrumented rounds alternate which goes first. Workloads:

- ``noop``: ``--tasks`` no-op tasks with ``client.map``;
- ``graph``: one graph of ``--tasks`` tasks (half leaves, half a binary tree summing them);
- ``movement``: an array multiplied by its transpose across both workers (dependency
  transfers), then 128 MB persisted on workers whose spill target is 36 MB each and
  summed (spilling and reading back).

    python benchmarks/overhead.py --tasks 20000 --rounds 7 --export otlp
    python benchmarks/overhead.py --workload graph --tasks 4000 --rounds 7 --export otlp
    python benchmarks/overhead.py --workload movement --rounds 15 --export otlp
    python benchmarks/overhead.py --tasks 20000 --rounds 3 --processor dask-otel --processor sdk
    python benchmarks/overhead.py --workload graph --tasks 4000 --rounds 7 --processes
    python benchmarks/overhead.py --workload graph --tasks 4000 --rounds 7 \
        --variant nospans:otel.task.sample-ratio=0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import psutil
import yaml
from distributed import Client, LocalCluster, wait
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import dask_otel
from dask_otel.distro import sdk
from dask_otel.export import processors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# The OTLP receiver the tests, benchmarks and scripts share, in a process of its own.
from otlp_receiver import spawn_counting as start_receiver


class DiscardingExporter(SpanExporter):
    """Counts spans and drops them: the cost of making spans, not of shipping them."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: Sequence) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS


class DiscardingMetricExporter(MetricExporter):
    """Takes every collection (so callbacks and aggregation run) and drops it."""

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def noop(i: int) -> int:
    return i


def add(a: int, b: int) -> int:
    return a + b


def run_noop(client: Client, tasks: int) -> None:
    client.gather(client.map(noop, range(tasks), pure=False))


def run_graph(client: Client, tasks: int) -> None:
    """One graph: ``tasks / 2`` leaves summed pairwise up a tree (``tasks - 1`` in all)."""
    level = [dask.delayed(noop)(i, dask_key_name=f"leaf-{i}") for i in range(tasks // 2)]
    while len(level) > 1:
        level = [
            dask.delayed(add)(*level[i : i + 2]) if i + 1 < len(level) else level[i]
            for i in range(0, len(level), 2)
        ]
    assert client.compute(level[0]).result() == sum(range(tasks // 2))


def run_movement(client: Client, tasks: int) -> None:
    x = da.random.random((3000, 3000), chunks=(500, 500))
    (x @ x.T).sum().compute()
    numbers = da.arange(16_000_000, chunks=500_000, dtype=float).persist()
    wait(numbers)
    assert float(numbers.sum().compute()) == 16_000_000 * 15_999_999 / 2
    del numbers


WORKLOADS = {"noop": run_noop, "graph": run_graph, "movement": run_movement}
#: Worker memory for the movement workload: 60 MB each, spilling above 36 MB (target),
#: and no process-memory thresholds (the benchmark process is the workers' process).
MOVEMENT_MEMORY = {
    "distributed.worker.memory.target": 0.6,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by each live thread of this process, by native thread id
    (Python's ``ident`` of an ended thread is reused)."""
    times = {}
    for thread in threading.enumerate():
        try:
            clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
            times[thread.native_id] = (thread.name, time.clock_gettime(clock))
        except (OSError, TypeError):
            pass  # ended meanwhile
    return times


THREAD_GROUPS = {
    "loop": "event loop (scheduler, and the workers unless --processes)",
    "tasks": "task threads (executors)",
    "dask-otel": "dask-otel span emitters",
    "dask-otel-export": "dask-otel export queues (checks, encoding or rebuilding, export)",
    "sdk": "OpenTelemetry SDK (batch processor, metrics)",
    "other": "other threads",
    "ended": "threads that ended during the round",
    "gc": "garbage collection (part of the above)",
    "workers": "worker processes (--processes)",
    "receiver": "the OTLP receiver (--export otlp, --processes)",
}


def thread_group(name: str) -> str:
    """The part of the process a thread's CPU is charged to."""
    if name == "IO loop":
        return "loop"  # the event loop of the scheduler and both workers
    if name.startswith("dask-otel-export"):
        return "dask-otel-export"
    if name.startswith("dask-otel"):
        return "dask-otel"
    if name.startswith("Otel"):
        return "sdk"
    if "Dask-Default-Threads" in name:
        return "tasks"
    return "other"


#: Seconds spent in garbage collection during a round (in whichever thread triggered it,
#: so also counted in that thread's CPU), and the number of full collections.
gc_stats: Counter = Counter()
_gc_started = [0.0]


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    gc_stats["gc"] += time.perf_counter() - _gc_started[0]
    gc_stats["full collections"] += info["generation"] == 2


gc.callbacks.append(_time_gc)


def process_cpu(processes: list[psutil.Process]) -> float:
    """CPU seconds used so far by ``processes`` (user and system)."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def one_round(
    workload: str, tasks: int, env: dict[str, str] | None, receiver: psutil.Process | None
) -> tuple[float, float, Counter]:
    """(wall seconds, CPU seconds of the cluster's processes, CPU seconds by thread group)
    to run ``workload`` on a new cluster: in this process, or with ``env`` its workers in
    processes of their own (Nanny) with that environment."""
    memory = workload == "movement"
    with (
        dask.config.set(MOVEMENT_MEMORY if memory else {}),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=env is not None,
            dashboard_address="127.0.0.1:0",
            memory_limit="60MB" if memory else "auto",
            **({"host": "127.0.0.1", "env": env} if env is not None else {}),
        ) as cluster,
        Client(cluster) as client,
    ):
        client.gather(client.map(noop, range(50), pure=False))  # warm up
        workers = [psutil.Process(w.pid) for w in cluster.workers.values() if env is not None]
        others = {"workers": workers, "receiver": [receiver] if receiver else []}
        gc.collect()
        before = thread_cpu()
        before_others = {name: process_cpu(ps) for name, ps in others.items()}
        gc_stats.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        WORKLOADS[workload](client, tasks)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        groups: Counter = Counter()
        for tid, (name, seconds) in thread_cpu().items():
            groups[thread_group(name)] += seconds - before.get(tid, (name, 0.0))[1]
        # Threads that ended during the round (an emitter thread ends after 1 s idle, e.g.
        # while the client gathers) took the rest of the process's CPU time with them.
        groups["ended"] = max(0.0, cpu - sum(groups.values()))
        for name, ps in others.items():
            groups[name] = process_cpu(ps) - before_others[name]
        groups.update(gc_stats)
        return wall, cpu + groups["workers"], groups


def spans_received(receiver: subprocess.Popen) -> int:
    """Spans the receiver counted, read from its last answer once its input ends."""
    state = json.loads(receiver.communicate("")[0].strip().splitlines()[-1])
    return sum(state["spans"].values())


def make_exporter(endpoint: str | None, sdk_encoding: bool = False) -> SpanExporter:
    """Discarding, or OTLP/gRPC to ``endpoint``: encoded by dask-otel from its queued
    tuples (lever (d)), or with ``sdk_encoding`` by the SDK's encoder from ReadableSpans
    (an exporter of a subclass: dask-otel takes over only the OTLP exporter itself)."""
    if endpoint is None:
        return DiscardingExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter_class = (
        type("SdkEncoded", (OTLPSpanExporter,), {}) if sdk_encoding else OTLPSpanExporter
    )
    return exporter_class(endpoint=endpoint, insecure=True)


class ApiPathTracerProvider(TracerProvider):
    """The SDK's provider, its tracers of a subclass of the SDK's: dask-otel then builds
    its spans through ``start_span``, as for another SDK (lever (c) off)."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        tracer = super().get_tracer(*args, **kwargs)
        tracer.__class__ = type("ApiPathTracer", (type(tracer),), {})
        return tracer


def worker_env(endpoint: str) -> dict[str, str]:
    """The environment of worker processes (``--processes``): what a user sets for
    ``opentelemetry-instrument`` or ``--preload dask_otel``, all signals over OTLP/gRPC,
    metrics collected every 5 s like the benchmark's own reader. Plain rounds have it
    too; nothing reads it there."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "otlp",
        "OTEL_METRIC_EXPORT_INTERVAL": "5000",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="noop")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--export", choices=["discard", "otlp"], default="discard")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="the workers in processes of their own (Nanny), as on a real cluster, "
        "exporting over OTLP/gRPC to the receiver (implies --export otlp); the scheduler "
        "and the client stay in this process",
    )
    parser.add_argument(
        "--processor",
        action="append",
        choices=sorted(PROCESSORS),
        help="span processor of the instrumented rounds: the one dask-otel configures "
        "(default), the SDK's BatchSpanProcessor, dask-otel's with spans built through "
        "start_span (api-path) or encoded by the SDK (sdk-encoding, with --export otlp); "
        "give several: every round then runs plain and once with each",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dask config for the instrumented rounds, e.g. otel.task.sample-ratio=0",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also run every round instrumented with this dask config on top of --set "
        "(with the first processor), e.g. nospans:otel.task.sample-ratio=0; reported "
        "against plain and against the default instrumented rounds",
    )
    args = parser.parse_args()
    settings = dask_config(args.set)
    processors = list(dict.fromkeys(args.processor or ["dask-otel"]))
    variants = {
        name: {**settings, **dask_config(spec.split(","))}
        for name, spec in (item.split(":", 1) for item in args.variant)
    }

    endpoint, receiver = (None, None)
    if args.export == "otlp" or args.processes:
        endpoint, receiver = start_receiver()
    env = worker_env(endpoint) if args.processes else None  # type: ignore[arg-type]
    watched = psutil.Process(receiver.pid) if receiver is not None else None
    # One exporter per processor: dask-otel's takes over the OTLP exporter it is given
    # (it encodes its queued spans), which the SDK's processor then could not use.
    exporters = {
        name: make_exporter(endpoint, sdk_encoding=name == "sdk-encoding") for name in processors
    }
    # The queue and batch sizes dask-otel sets, for either processor.
    for name in ("OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        os.environ.setdefault(name, sdk.ENV_DEFAULTS[name])
    providers = {}
    for name in processors:
        provider_class, processor = PROCESSORS[name]
        providers[name] = provider_class()
        providers[name].add_span_processor(processor(exporters[name]))
    meter_provider = MeterProvider(
        metric_readers=[
            PeriodicExportingMetricReader(DiscardingMetricExporter(), export_interval_millis=5000)
        ]
    )
    instrumentor = dask_otel.DaskInstrumentor()

    def run(mode: str) -> tuple[float, float, Counter]:
        if mode == "plain":
            return one_round(args.workload, args.tasks, env, watched)
        provider = providers[mode if mode in providers else processors[0]]
        instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
        try:
            with dask.config.set(variants.get(mode, settings)):
                return one_round(args.workload, args.tasks, env_of(mode), watched)
        finally:
            instrumentor.uninstrument()
            provider.force_flush()

    def env_of(mode: str) -> dict[str, str] | None:
        """Worker processes read dask config from ``DASK_*`` variables: a variant's too."""
        if env is None or mode not in variants:
            return env
        return {**env, **{dask_variable(k): str(v) for k, v in variants[mode].items()}}

    modes = ["plain", *processors, *variants]
    results: dict[str, list] = {mode: [] for mode in modes}
    try:
        for r, times in enumerate(interleaved(modes, args.rounds, run)):
            for mode in modes:
                results[mode].append(times[mode])
            plain = times["plain"]
            print(
                f"round {r + 1}: plain {plain[0]:.3f}s  "
                + "  ".join(
                    f"{name} {times[name][0]:.3f}s (ratio {times[name][0] / plain[0]:.3f}, "
                    f"cpu ratio {times[name][1] / plain[1]:.3f})"
                    for name in modes[1:]
                ),
                flush=True,
            )
    finally:
        for provider in providers.values():
            provider.shutdown()
        meter_provider.shutdown()
        received = spans_received(receiver) if receiver is not None else None

    for name in modes[1:]:
        report(args, name, results["plain"], results[name])
    for name in variants:
        ratios = [v[0] / d[0] for v, d in zip(results[name], results[processors[0]], strict=True)]
        print(
            f"\n{name} against {processors[0]}: wall ratio median "
            f"{statistics.median(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}"
        )
    discarded = [e.count for e in exporters.values() if isinstance(e, DiscardingExporter)]
    if discarded:
        print(f"spans exported: {sum(discarded)}")
    if received is not None:
        print(f"spans received over OTLP: {received}")


def interleaved(modes: list[str], rounds: int, run: Callable[[str], Any]) -> Iterator[dict]:
    """Each round's result of ``run`` for every mode, the modes run in turn and rotating
    which goes first, so that none always runs on a warmer machine."""
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        yield {mode: run(mode) for mode in order}


def median_range(values: list[float]) -> str:
    """Median (min-max), the figures every benchmark here reports."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def dask_config(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` items as dask config (values parsed as YAML)."""
    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items if item)}


def dask_variable(key: str) -> str:
    """The ``DASK_*`` environment variable of a dask config key."""
    return "DASK_" + key.upper().replace(".", "__").replace("-", "_")


#: Providers and span processors the instrumented rounds can use: dask-otel's, the SDK's
#: BatchSpanProcessor, and dask-otel's with one lever off: spans through the API
#: (``start_span``) instead of written as tuples, or encoded by the SDK's OTLP encoder.
PROCESSORS = {
    "dask-otel": (TracerProvider, processors.span_processor),
    "sdk": (TracerProvider, BatchSpanProcessor),
    "api-path": (ApiPathTracerProvider, processors.span_processor),
    "sdk-encoding": (TracerProvider, processors.span_processor),
}


def report(args: argparse.Namespace, processor: str, plains: list, traceds: list) -> None:
    """Ratios, CPU by thread group and garbage collection, instrumented vs plain."""
    ratios = [t[0] / p[0] for t, p in zip(traceds, plains, strict=True)]
    cpu_ratios = [t[1] / p[1] for t, p in zip(traceds, plains, strict=True)]
    # This process alone (with --processes: the scheduler, the client and their threads).
    own_ratios = [
        (t[1] - t[2]["workers"]) / (p[1] - p[2]["workers"])
        for t, p in zip(traceds, plains, strict=True)
    ]
    plain_wall = statistics.median(p[0] for p in plains)
    traced_wall = statistics.median(t[0] for t in traceds)
    extra = traced_wall - plain_wall
    per_task = "" if args.workload == "movement" else f", {1e6 * extra / args.tasks:.1f} us/task"
    print(
        f"\n{processor}: {args.workload} workload, --tasks {args.tasks}, "
        f"{args.rounds} interleaved rounds, "
        f"export={'otlp' if args.processes else args.export} processor={processor}"
        f"{' workers in processes' if args.processes else ''}"
        f" {' '.join(args.set)}\n"
        f"wall ratio  median {statistics.median(ratios):.3f}  "
        f"min {min(ratios):.3f}  max {max(ratios):.3f}\n"
        f"cpu ratio   median {statistics.median(cpu_ratios):.3f}  "
        f"min {min(cpu_ratios):.3f}  max {max(cpu_ratios):.3f}\n"
        f"cpu ratio of this process (scheduler, client) median "
        f"{statistics.median(own_ratios):.3f}  min {min(own_ratios):.3f}  "
        f"max {max(own_ratios):.3f}\n"
        f"plain median {plain_wall:.3f}s  instrumented median {traced_wall:.3f}s  "
        f"(+{extra:.3f}s{per_task})"
    )
    # The movement workload has no task count of its own: its CPU is per round.
    movement = args.workload == "movement"
    unit, scale = ("ms per round", 1e3) if movement else ("us per task", 1e6 / args.tasks)
    print(f"CPU {unit} by thread (median plain -> instrumented):")
    for group in THREAD_GROUPS:
        plain_cpu = statistics.median(scale * p[2][group] for p in plains)
        traced_cpu = statistics.median(scale * t[2][group] for t in traceds)
        print(f"  {THREAD_GROUPS[group]:<48} {plain_cpu:8.1f} -> {traced_cpu:8.1f}")
    full = [
        statistics.median(r[2]["full collections"] for r in rounds) for rounds in (plains, traceds)
    ]
    print(f"full collections per round (median): {full[0]:.0f} -> {full[1]:.0f}")


if __name__ == "__main__":
    main()
