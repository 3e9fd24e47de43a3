"""Overhead of dask-otel with each role in a process of its own, as deployed.

``benchmarks/overhead.py --processes`` keeps the scheduler, the client and the Nannies in
one process, so the scheduler's own share of the added CPU cannot be told apart. Here
every round starts ``dask scheduler`` and ``dask worker --nworkers 2 --nthreads 1`` from
their command lines (instrumented: under ``opentelemetry-instrument``, the zero-code way
in, every signal over OTLP/gRPC to the tests' counting receiver), connects a client from
this process (instrumented: ``DaskInstrumentor().instrument()``), runs the workload and
stops them. Plain and instrumented rounds (and ``--variant`` rounds, whose dask config
reaches every process as ``DASK_*`` variables) interleave, rotating which goes first.

``--pin`` puts the scheduler alone on one CPU, everything else on the others: on a
machine of 2 cores, the scheduler's CPU then no longer pays for the workers' added work
through the caches and time slices it shares with them.

Reported: the wall ratio, and CPU per task of each process (scheduler, the Nannies' one
process, the two worker processes, this client, the receiver), medians with min-max; and of
the scheduler's event-loop thread alone (``loop``: its main thread, read in nanoseconds
from ``/proc``, where the processes' figures count 10 ms ticks).

    python benchmarks/deployed.py --workload graph --tasks 4000 --rounds 7
    python benchmarks/deployed.py --workload graph --tasks 4000 --rounds 7 \
        --against before=/tmp/before-checkout

``--against NAME=DIR`` (repeatable) adds instrumented rounds whose scheduler and worker
processes import ``dask_otel`` from the checkout DIR (first on their ``PYTHONPATH``): two
versions of the code side by side in one run. The client in this process keeps this
checkout's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import overhead
import psutil
import scheduler_probe
from distributed import Client
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider

from dask_otel import DaskInstrumentor
from dask_otel.export import processors

#: The processes whose CPU each round reports, in this order (``loop``: the scheduler's
#: event-loop thread).
ROLES = ("scheduler", "loop", "nannies", "workers", "client", "receiver")


def loop_cpu(process: psutil.Process) -> float:
    """CPU seconds of ``process``'s main thread (the event loop of ``dask scheduler``):
    the kernel's nanosecond count (``schedstat``), not the 10 ms ticks of ``cpu_times``."""
    with open(f"/proc/{process.pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def command(name: str) -> str:
    """An entry point of this virtualenv (beside its Python)."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else shutil.which(name) or name


class Deployment:
    """A scheduler and two Nanny workers started from the command line; stops them."""

    #: With ``--pin``: the CPUs of the scheduler, and of everything else.
    pinned: tuple[set[int], set[int]] | None = None

    def __init__(self, env: dict[str, str], instrumented: bool) -> None:
        self._dir = tempfile.mkdtemp(prefix="dask-otel-deployed-")
        scheduler_file = os.path.join(self._dir, "scheduler.json")
        prefix = [command("opentelemetry-instrument")] if instrumented else []
        common = ["--host", "127.0.0.1", "--no-dashboard"]
        #: Scheduler first, then the ``dask worker`` process that hosts both Nannies.
        self.processes = [
            subprocess.Popen(
                [
                    *prefix,
                    command("dask"),
                    "scheduler",
                    *common,
                    "--port",
                    "0",
                    "--scheduler-file",
                    scheduler_file,
                ],
                env=env,
                stderr=None if os.environ.get("DEPLOYED_DEBUG") else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=self._on_cpus(0),
            )
        ]
        deadline = time.monotonic() + 60
        while not os.path.exists(scheduler_file):
            if time.monotonic() > deadline or self.processes[0].poll() is not None:
                self.stop()
                raise RuntimeError("the scheduler wrote no scheduler file")
            time.sleep(0.05)
        self.scheduler_file = scheduler_file
        self.processes.append(
            subprocess.Popen(
                [
                    *prefix,
                    command("dask"),
                    "worker",
                    "--scheduler-file",
                    scheduler_file,
                    *common,
                    "--nworkers",
                    "2",
                    "--nthreads",
                    "1",
                ],
                env=env,
                stderr=None if os.environ.get("DEPLOYED_DEBUG") else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=self._on_cpus(1),
            )
        )

    def _on_cpus(self, which: int) -> Callable[[], None] | None:
        """Run in the child before it starts: its CPUs, with ``--pin``."""
        if self.pinned is None:
            return None
        cpus = self.pinned[which]
        return lambda: os.sched_setaffinity(0, cpus)

    def watched(self) -> dict[str, list[psutil.Process]]:
        """The processes of each role, once the workers run."""
        scheduler, nannies = (psutil.Process(p.pid) for p in self.processes)
        return {
            "scheduler": [scheduler],
            "nannies": [nannies],
            "workers": nannies.children(recursive=True),
        }

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def one_round(
    workload: Callable[[Client, int], None],
    tasks: int,
    env: dict[str, str],
    instrumented: bool,
    receiver: psutil.Process,
    probe: bool = False,
) -> tuple[float, dict[str, float]]:
    """(wall seconds, CPU seconds by role) of ``workload`` on a new deployment; with
    ``probe``, also by entry point of the scheduler's ``scheduler_probe``."""
    deployment = Deployment(env, instrumented)
    try:
        with Client(scheduler_file=deployment.scheduler_file) as client:
            client.wait_for_workers(2, timeout=60)
            client.gather(client.map(overhead.noop, range(50), pure=False))  # warm up
            roles = {**deployment.watched(), "client": [psutil.Process()], "receiver": [receiver]}
            scheduler = roles["scheduler"][0]
            before = {role: overhead.process_cpu(ps) for role, ps in roles.items()}
            if probe:
                before.update(client.run_on_scheduler(scheduler_probe.snapshot))
            before["loop"] = loop_cpu(scheduler)
            wall = time.perf_counter()
            workload(client, tasks)
            wall = time.perf_counter() - wall
            cpu = {role: overhead.process_cpu(ps) - before[role] for role, ps in roles.items()}
            cpu["loop"] = loop_cpu(scheduler) - before["loop"]
            if probe:
                for name, seconds in client.run_on_scheduler(scheduler_probe.snapshot).items():
                    cpu[name] = seconds - before.get(name, 0.0)
    finally:
        deployment.stop()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["graph", "noop"], default="graph")
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also run every round instrumented with this dask config, in every process",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run every round instrumented with dask_otel imported from checkout DIR",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="time dask-otel's entry points on the scheduler's event loop "
        "(benchmarks/scheduler_probe.py, a scheduler preload in every round)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the scheduler alone on CPU 0; the workers, this client and the receiver on "
        "the others (as on a cluster, where the scheduler has a host of its own)",
    )
    parser.add_argument(
        "--slowed",
        type=float,
        metavar="US",
        help="also run every round plain with workers whose event loop spins US "
        "microseconds per task (benchmarks/slow_worker.py): how the scheduler's CPU per "
        "task answers slower workers without dask-otel",
    )
    args = parser.parse_args()
    endpoint, receiver_process = overhead.start_receiver()
    receiver = psutil.Process(receiver_process.pid)
    if args.pin:
        others = set(range(1, os.cpu_count() or 2))
        Deployment.pinned = ({0}, others)
        for pid in (os.getpid(), receiver.pid):  # every thread of this process and the receiver's
            for thread in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(thread), others)
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    # The workloads' functions are pickled by reference to this directory's modules.
    plain_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")])
    )
    if args.probe:
        plain_env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"] = '["scheduler_probe"]'
    otel_env = {**plain_env, **overhead.worker_env(endpoint)}
    #: Each instrumented mode's dask config, and the checkout its processes import from.
    variants: dict[str, tuple[dict[str, object], str | None]] = {"dask-otel": ({}, None)}
    for item in args.variant:
        name, spec = item.split(":", 1)
        variants[name] = (overhead.dask_config(spec.split(",")), None)
    for item in args.against:
        name, checkout = item.split("=", 1)
        variants[name] = ({}, str(Path(checkout).resolve()))
    provider = TracerProvider()
    provider.add_span_processor(processors.span_processor(overhead.make_exporter(endpoint)))
    meter_provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(overhead.DiscardingMetricExporter())]
    )
    instrumentor = DaskInstrumentor()
    workload = overhead.WORKLOADS[args.workload]

    slowed_env = {
        **plain_env,
        "DASK_DISTRIBUTED__WORKER__PRELOAD": '["slow_worker"]',
        "SLOW_WORKER_US": str(args.slowed),
    }

    def run(mode: str) -> tuple[float, dict[str, float]]:
        if mode in ("plain", "slowed"):
            env = plain_env if mode == "plain" else slowed_env
            return one_round(workload, args.tasks, env, False, receiver, args.probe)
        config, checkout = variants[mode]
        env = {**otel_env, **{overhead.dask_variable(k): str(v) for k, v in config.items()}}
        if checkout is not None:
            env["PYTHONPATH"] = os.pathsep.join([checkout, env["PYTHONPATH"]])
        instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
        try:
            return one_round(workload, args.tasks, env, True, receiver, args.probe)
        finally:
            instrumentor.uninstrument()
            provider.force_flush()

    modes = ["plain", *(["slowed"] if args.slowed else []), *variants]
    results: dict[str, list[tuple[float, dict[str, float]]]] = {mode: [] for mode in modes}
    try:
        for r, times in enumerate(overhead.interleaved(modes, args.rounds, run)):
            for mode in modes:
                results[mode].append(times[mode])
            print(
                f"round {r + 1}: "
                + "  ".join(
                    f"{mode} {times[mode][0]:.3f}s (scheduler "
                    f"{1e6 * times[mode][1]['scheduler'] / args.tasks:.0f} us/task, loop "
                    f"{1e6 * times[mode][1]['loop'] / args.tasks:.0f})"
                    for mode in modes
                ),
                flush=True,
            )
    finally:
        provider.shutdown()
        meter_provider.shutdown()
        received = overhead.spans_received(receiver_process)

    plains = results["plain"]
    scale = 1e6 / args.tasks
    print(
        f"\n{args.workload} workload, --tasks {args.tasks}, {args.rounds} interleaved rounds, "
        "each role in a process of its own; median (min-max)"
    )
    for mode in modes[1:]:
        traced = results[mode]
        wall = [t[0] / p[0] for t, p in zip(traced, plains, strict=True)]
        print(f"\n{mode}: wall ratio {overhead.median_range(wall)}")
        print("  CPU us per task, plain -> instrumented, ratio:")
        for role in ROLES:
            before = [p[1][role] * scale for p in plains]
            after = [t[1][role] * scale for t in traced]
            ratios = [
                t[1][role] / p[1][role] if p[1][role] else float("nan")
                for t, p in zip(traced, plains, strict=True)
            ]
            print(
                f"    {role:<10} {statistics.median(before):8.1f} -> "
                f"{statistics.median(after):8.1f}   ratio {overhead.median_range(ratios)}"
            )
        if args.probe:
            print("  on the scheduler's event loop, us per task (scheduler_probe):")
            probed = traced[0][1].keys() - {*ROLES, *scheduler_probe.messages}
            for name in sorted(probed - {"compute-task message (Dask)"}):
                spent = [t[1][name] * scale for t in traced]
                print(f"    {name:<22} {overhead.median_range(spent)}")
            print("  the scheduler's comm messages per task, plain -> instrumented:")
            for name in scheduler_probe.messages:
                before = [p[1][name] / args.tasks for p in plains]
                after = [t[1][name] / args.tasks for t in traced]
                print(
                    f"    {name:<22} {overhead.median_range(before)} -> "
                    f"{overhead.median_range(after)}"
                )
    print(f"\nspans received over OTLP: {received}")


if __name__ == "__main__":
    main()
