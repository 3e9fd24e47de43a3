"""What the flight recorder costs a worker: per record, and on a whole workload.

Per call (``--micro``): copying one span as queued for export (a real ``execute``-like
span from the SDK, compacted as dask-otel's queue holds it), one log record, and one
task attempt's slot (started, ended, reported); medians with min-max over the rounds.

On a workload (default): a ``LocalCluster`` whose workers run in processes of their own
(each with a Nanny running dask-otel, exporting spans, metrics and logs over OTLP/gRPC
to the tests' counting OTLP receiver), every task traced, with the flight recorder on and off
(``otel.nanny.flight-recorder: 0``) in interleaved rounds; the ratios on/off of wall time
and of the worker processes' CPU time, median with min-max.

What survives (``--survival``): tests/scripts/post_mortem.py's scenario on real
processes (a scheduler, two ``dask worker`` processes at ``--memory-limit 400MB`` whose
exports wait a minute, so that nothing leaves a worker except through its Nanny; a task
killed twice by the memory monitor, then a worker SIGKILLed mid-task), with the flight
recorder on and off: what reached the collector of what the dead workers recorded.

    python benchmarks/flight.py --micro --rounds 7
    python benchmarks/flight.py --workload graph --tasks 4000 --rounds 7
    python benchmarks/flight.py --survival
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import dask
from opentelemetry._logs import LogRecord
from opentelemetry.sdk._logs import ReadWriteLogRecord
from opentelemetry.sdk.trace import TracerProvider

sys.path.insert(0, str(Path(__file__).parent))
from overhead import (
    DiscardingExporter,
    DiscardingMetricExporter,
    median_range,
    one_round,
    start_receiver,
    worker_env,
)

import dask_otel
from dask_otel.export import queued_spans, recorder_copy
from dask_otel.postmortem import flight_recorder


def micro(rounds: int, calls: int) -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("dask_otel", "0")
    shared = queued_spans.SharedObjects()
    span = tracer.start_span(
        "execute inc",
        attributes={
            "dask.worker.address": "tcp://10.0.0.1:40123",
            "dask.worker.name": "worker-0",
            "dask.cluster.id": "Scheduler-3f2a1b0c-1234-5678-9abc-def012345678",
            "dask.task.key": "('inc-6f1b3e1c0a5d4e2f9b8c7d6e5f4a3b2c', 12)",
            "dask.task.prefix": "inc",
            "dask.task.group": "inc",
        },
    )
    span.set_attribute("thread.id", 140234)
    span.end()
    values = queued_spans.compact(span, shared)  # type: ignore[arg-type]
    record = ReadWriteLogRecord(
        LogRecord(
            timestamp=time.time_ns(),
            severity_text="INFO",
            body="Starting established connection to tcp://10.0.0.2:8786",
            attributes={"code.function.name": "handle_stream", "dask.cluster.id": "x" * 45},
        ),
        resource=span.resource,
        instrumentation_scope=span.instrumentation_scope,
    )
    with tempfile.TemporaryDirectory() as folder:
        recorder = flight_recorder.FlightRecorder(
            Path(folder) / "1.flight", 4 * 2**20, flight_recorder.SLOTS
        )

        def copy_span() -> None:
            with recorder.lock:
                recorder.span(values, span.resource, span.instrumentation_scope)

        def copy_log() -> None:
            values = recorder_copy.compact_log(record.log_record)
            with recorder.lock:
                recorder.log(values, record.resource, record.instrumentation_scope)

        annotation = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"

        def attempt() -> None:
            slot = recorder.started("('inc-6f1b3e1c0a5d4e2f', 12)", "inc", annotation, 7, 1)
            recorder.ended(slot)
            recorder.reported(slot)

        for name, call in (("span copy", copy_span), ("log copy", copy_log), ("attempt", attempt)):
            per_call = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                per_call.append((time.perf_counter() - start) / calls * 1e6)
            print(f"{name:<10} {median_range(per_call)} us per call")


def workload(name: str, tasks: int, rounds: int) -> None:
    endpoint, receiver = start_receiver()
    import psutil
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter()))
    reader = PeriodicExportingMetricReader(DiscardingMetricExporter(), 5000)
    dask_otel.DaskInstrumentor().instrument(
        tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    env = worker_env(endpoint)
    size = dask.config.get("otel.nanny.flight-recorder")
    walls: dict[str, list[float]] = {"on": [], "off": []}
    cpus: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for i in range(rounds):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                config = {"otel.nanny.flight-recorder": size if arm == "on" else 0}
                with dask.config.set(config):
                    wall, _, groups = one_round(name, tasks, env, psutil.Process(receiver.pid))
                walls[arm].append(wall)
                cpus[arm].append(groups["workers"])
            print(
                f"round {i}: wall on {walls['on'][-1]:.3f} s off {walls['off'][-1]:.3f} s; "
                f"worker CPU on {cpus['on'][-1]:.3f} s off {cpus['off'][-1]:.3f} s",
                flush=True,
            )
    finally:
        receiver.stdin.close()  # type: ignore[union-attr]
        receiver.wait()
    wall_ratios = [on / off for on, off in zip(walls["on"], walls["off"], strict=True)]
    cpu_ratios = [on / off for on, off in zip(cpus["on"], cpus["off"], strict=True)]
    print(f"{name}, {tasks} tasks, {rounds} rounds, flight recorder on / off:")
    print(f"  wall time        {median_range(wall_ratios)}")
    print(f"  worker CPU time  {median_range(cpu_ratios)}")
    per_task = [(on - off) / tasks * 1e6 for on, off in zip(cpus["on"], cpus["off"], strict=True)]
    print(f"  worker CPU per task, on minus off: {median_range(per_task)} us")


def survival() -> None:
    tests = Path(__file__).parent.parent / "tests"
    sys.path.insert(0, str(tests))
    import json
    import subprocess

    from conftest import Processes, bin_path, otel_env, start_scheduler, start_worker
    from otlp_receiver import OTLPReceiver

    script = tests / "scripts" / "post_mortem.py"
    for size in ("4MiB", "0"):
        with tempfile.TemporaryDirectory() as folder, OTLPReceiver() as rx:
            processes = Processes(Path(folder))
            env = otel_env(rx, DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="1")
            held = {**env, "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BLRP_SCHEDULE_DELAY": "60000"}
            held["DASK_OTEL__NANNY__FLIGHT_RECORDER"] = size
            try:
                address = start_scheduler(processes, env)
                nannies = [
                    start_worker(
                        processes, held, address, f"w{i}", options=("--memory-limit", "400MB")
                    )
                    for i in range(2)
                ]
                out = subprocess.run(
                    [bin_path("opentelemetry-instrument"), sys.executable, str(script), address],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                    cwd=folder,
                )
                observed = json.loads(out.stdout.strip().splitlines()[-1])
                for nanny in nannies:
                    processes.stop(nanny)
                time.sleep(2)
            finally:
                processes.stop_all()
            died = [r for r in rx.log_records() if r["event_name"] == "dask.worker.died"]
            workers = [s for s in rx.spans() if s["resource"]["service.name"] == "dask-worker"]
            ticks = [s for s in workers if s["name"] == "task tick"]
            user = [r for r in rx.log_records() if str(r["body"]).startswith(("hog:", "sleeper:"))]
            keys = sum(bool(r["attributes"].get("dask.task.keys")) for r in died)
            lines = sum(bool(r["attributes"].get("dask.worker.last_logs")) for r in died)
            print(
                f"flight recorder {size}: {len(died)} death records ({keys} name the task "
                f"executing, {lines} quote the last log lines); spans from workers "
                f"{len(workers)}, of them task tick {len(ticks)} of 90; the tasks' own log "
                f"records {len(user)} of 4 ({observed['sleeper']})"
            )
            for record in died:  # what each Nanny sent for its dead worker
                a = record["attributes"]
                print(
                    f"  {a['dask.worker.death.cause']} ({a.get('dask.worker.death.signal')}): "
                    f"sent {a.get('dask_otel.recovered.spans', 0)} spans, "
                    f"{a.get('dask_otel.recovered.logs', 0)} log records; "
                    f"{len(a.get('dask.task.unreported', ()))} attempts unreported, "
                    f"{a.get('dask_otel.lost', 0)} lost"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", action="store_true", help="per-call costs only")
    parser.add_argument("--survival", action="store_true", help="what survives, measured")
    parser.add_argument("--workload", default="graph", choices=("noop", "graph"))
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50_000, help="calls per round (--micro)")
    args = parser.parse_args()
    if args.survival:
        survival()
    elif args.micro:
        micro(args.rounds, args.calls)
    else:
        workload(args.workload, args.tasks, args.rounds)


if __name__ == "__main__":
    main()
