"""Stopping Dask with the collector down or hung: restart, close, SIGTERM and exit times.

Each case runs plain (no dask-otel) and instrumented against four collectors: up (a
receiver in another process), down (a closed port on 127.0.0.1), hung over TCP (a
listener that accepts connections and never reads them) and hung over gRPC (a server
that takes every export request and never answers). Every round starts fresh processes;
rounds interleave the collectors. Exports are scheduled every second
(``OTEL_BSP_SCHEDULE_DELAY``/``OTEL_BLRP_SCHEDULE_DELAY``, metrics every 2 s) and each
stop comes ``--settle`` seconds after the last computation, so that the processes have
tried (and, the collector down or hung, failed) to export before they stop.

- ``restart``: ``client.restart()`` of a ``LocalCluster(n_workers=2, processes=True)``
  (Nanny workers), after a computation; ``close``: ``client.close()`` and
  ``cluster.close()`` after another; ``script exit``: that script, from its last line to
  the end of its process. Instrumented with ``dask_otel.instrument()`` before the cluster
  starts (the SDK configured from ``OTEL_*`` in every process).
- ``nanny SIGTERM``: ``dask worker`` with a Nanny, from SIGTERM to the Nanny until it has
  exited; ``scheduler SIGTERM`` likewise for ``dask scheduler``; ``client exit``: a client
  script's exit, from its last line to the end of its process. Instrumented with
  ``opentelemetry-instrument``.

Also counted over all rounds: workers their Nanny killed ("Worker process still alive
after ... killing"), processes that said their loss on stderr ("dask-otel: ... not
exported"), and runs that failed (a script that exited with an error: its round has no
times for that collector).

    python benchmarks/outage.py --rounds 7
    python benchmarks/outage.py --rounds 7 --cases processes --collectors plain,up,down \
        --against main=/tmp/main-checkout   # also each instrumented kind with that checkout
    python benchmarks/outage.py --memory    # a worker's RSS over 20 computations

``--against NAME=DIR`` (repeatable) also runs every instrumented collector kind with
``PYTHONPATH=DIR``, so with the dask-otel of that checkout (``git archive main dask_otel``
unpacked in ``DIR``), in the same interleaved rounds: its columns are ``KIND@NAME``.

``--memory`` runs 20 computations of ``--tasks`` tasks on a one-worker ``LocalCluster``
with worker processes, plain and instrumented with the collector up and down, and prints
the worker process's resident memory after each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from otlp_receiver import UNANSWERED, exporting_env, spawn_counting, unanswered  # noqa: E402

BIN = Path(sys.executable).parent
COLLECTORS = ("plain", "up", *UNANSWERED)
CLUSTER_TIMES = ("restart", "close", "script exit")
PROCESS_TIMES = ("nanny SIGTERM", "scheduler SIGTERM", "client exit")

WORK = """
import operator

def work(client, tag, n=200):
    added = client.map(operator.add, range(n), range(n), key=[f"{tag}-{i}" for i in range(n)])
    assert client.submit(sum, added, key=f"{tag}sum").result() == n * (n - 1)
    try:
        client.submit(operator.truediv, 1, 0, key=f"{tag}fail").result()
    except ZeroDivisionError:
        pass
"""

CLUSTER = (
    WORK
    + """
import json, sys, time
from distributed import Client, LocalCluster
if sys.argv[1] == "instrumented":
    import dask_otel
    dask_otel.instrument()
settle = float(sys.argv[2])
cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                       dashboard_address="127.0.0.1:0")
client = Client(cluster)
work(client, "before")
time.sleep(settle)
started = time.perf_counter()
client.restart()
restart = time.perf_counter() - started
work(client, "after")
time.sleep(settle)
started = time.perf_counter()
client.close()
cluster.close()
close = time.perf_counter() - started
print(json.dumps({"restart": restart, "close": close, "end": time.time()}), flush=True)
"""
)

CLIENT = (
    WORK
    + """
import sys, time
from distributed import Client
with Client(sys.argv[1], timeout=30) as client:
    client.wait_for_workers(1, timeout=60)
    work(client, "client")
print(time.time(), flush=True)
"""
)

MEMORY = """
import json, sys
import psutil
from distributed import Client, LocalCluster
if sys.argv[1] == "instrumented":
    import dask_otel
    dask_otel.instrument()
rounds, tasks = int(sys.argv[2]), int(sys.argv[3])

def inc(x):
    return x + 1

def rss():
    return psutil.Process().memory_info().rss

with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                  dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
    sizes = [next(iter(client.run(rss).values()))]
    for i in range(rounds):
        keys = [f"inc{i}-{j}" for j in range(tasks)]
        total = sum(client.gather(client.map(inc, range(tasks), key=keys)))
        assert total == tasks * (tasks + 1) // 2
        sizes.append(next(iter(client.run(rss).values())))
print(json.dumps(sizes), flush=True)
"""


@contextlib.contextmanager
def collector(kind: str) -> Iterator[str]:
    """An OTLP/gRPC endpoint on 127.0.0.1 that is up, down or hung (``plain``: down)."""
    if kind != "up":
        with unanswered("down" if kind == "plain" else kind) as endpoint:
            yield endpoint
        return
    endpoint, receiver = spawn_counting()
    try:
        yield endpoint
    finally:
        receiver.communicate("")


def environment(endpoint: str, checkout: str | None = None) -> dict[str, str]:
    """The processes' environment; ``checkout``: a directory whose dask_otel they import."""
    return exporting_env(
        endpoint,
        OTEL_BSP_SCHEDULE_DELAY="1000",
        OTEL_BLRP_SCHEDULE_DELAY="1000",
        OTEL_METRIC_EXPORT_INTERVAL="2000",
        **({"PYTHONPATH": checkout} if checkout else {}),
    )


def count_complaints(text: str, counts: dict[str, int]) -> None:
    counts["workers killed by their Nanny"] += text.count("Worker process still alive after")
    counts["losses said"] += sum(
        1 for line in text.splitlines() if "dask-otel:" in line and "not exported" in line
    )


def run_script(args: list[str], env: dict[str, str], counts: dict, **options: Any) -> tuple:
    """Run a script to its end: its last line of output, and when it ended."""
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800, **options)
    ended = time.time()
    if out.returncode:
        raise RuntimeError(f"{args} failed:\n{out.stdout}\n{out.stderr}")
    count_complaints(out.stderr, counts)
    return out.stdout.strip().splitlines()[-1], ended


def run_cluster(kind: str, env: dict[str, str], settle: float, counts: dict) -> dict[str, float]:
    mode = "plain" if kind == "plain" else "instrumented"
    with tempfile.TemporaryDirectory() as tmp:
        script = [sys.executable, "-c", CLUSTER, mode, str(settle)]
        line, ended = run_script(script, env, counts, cwd=tmp)
    result = json.loads(line)
    result["script exit"] = ended - result.pop("end")
    return result


def _wait_for_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.1)


def _sigterm(proc: subprocess.Popen) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    return time.monotonic() - started


def run_processes(kind: str, env: dict[str, str], settle: float, counts: dict) -> dict[str, float]:
    wrap = [] if kind == "plain" else [str(BIN / "opentelemetry-instrument")]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        logs = {name: (directory / f"{name}.log").open("w+") for name in ("scheduler", "worker")}
        scheduler_file = directory / "scheduler.json"
        scheduler = subprocess.Popen(
            [*wrap, str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", str(scheduler_file)],
            env=env, cwd=tmp, stdout=logs["scheduler"], stderr=subprocess.STDOUT,
        )  # fmt: skip
        worker = None
        try:
            _wait_for_file(scheduler_file)
            address = json.loads(scheduler_file.read_text())["address"]
            worker = subprocess.Popen(
                [*wrap, str(BIN / "dask"), "worker", address, "--host", "127.0.0.1",
                 "--nthreads", "1", "--no-dashboard"],
                env=env, cwd=tmp, stdout=logs["worker"], stderr=subprocess.STDOUT,
            )  # fmt: skip
            line, ended = run_script(
                [*wrap, sys.executable, "-c", CLIENT, address], env, counts, cwd=tmp
            )
            time.sleep(settle)
            times = {
                "client exit": ended - float(line),
                "nanny SIGTERM": _sigterm(worker),
                "scheduler SIGTERM": _sigterm(scheduler),
            }
        finally:
            for proc in (worker, scheduler):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for log in logs.values():
            log.seek(0)
            count_complaints(log.read(), counts)
            log.close()
    return times


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


#: What ``--cases`` chooses from.
CASES = {"cluster": run_cluster, "processes": run_processes}


def timings(args: argparse.Namespace) -> None:
    collectors = args.collectors.split(",")
    checkouts = dict(entry.split("=", 1) for entry in args.against)
    kinds = tuple(collectors) + tuple(
        f"{kind}@{name}" for name in checkouts for kind in collectors if kind != "plain"
    )
    cases = [CASES[name] for name in args.cases.split(",")]
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    counts: dict[str, dict[str, int]] = {kind: defaultdict(int) for kind in kinds}
    for round_ in range(args.rounds):
        shift = round_ % len(kinds)  # interleaved: each round starts elsewhere
        for kind in kinds[shift:] + kinds[:shift]:
            collector_kind, _, checkout = kind.partition("@")
            measured: dict[str, float] = {}
            with collector(collector_kind) as endpoint:
                env = environment(endpoint, checkouts.get(checkout))
                for case in cases:
                    try:
                        measured.update(case(collector_kind, env, args.settle, counts[kind]))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:  # plain fails too
                        counts[kind]["runs failed"] += 1
                        print(f"round {round_ + 1} {kind} failed: {str(e)[-300:]}", file=sys.stderr)
            for name, seconds in measured.items():
                samples[name, kind].append(seconds)
            print(f"round {round_ + 1} {kind}: " + ", ".join(
                f"{name} {seconds:.2f}" for name, seconds in measured.items()
            ), file=sys.stderr, flush=True)  # fmt: skip
    print(f"\nseconds, median (min-max) of {args.rounds} rounds\n")
    print("| | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for name in CLUSTER_TIMES + PROCESS_TIMES:
        if not any(samples[name, k] for k in kinds):
            continue
        print(f"| {name} | " + " | ".join(cell(samples[name, k]) for k in kinds) + " |")
    for what in ("workers killed by their Nanny", "losses said", "runs failed"):
        print(f"| {what} (all rounds) | " + " | ".join(str(counts[k][what]) for k in kinds) + " |")


def memory(args: argparse.Namespace) -> None:
    print(f"worker RSS in MB: at start, then after each of {args.computations} computations "
          f"of {args.tasks} tasks\n")  # fmt: skip
    for kind in ("plain", "up", "down"):
        with collector(kind) as endpoint:
            mode = "plain" if kind == "plain" else "instrumented"
            script = [sys.executable, "-c", MEMORY, mode, str(args.computations), str(args.tasks)]
            line, _ = run_script(script, environment(endpoint), defaultdict(int))
        sizes = [round(b / 2**20) for b in json.loads(line)]
        print(f"{kind:>5}: {' '.join(map(str, sizes))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each stop")
    parser.add_argument("--memory", action="store_true", help="the worker's RSS instead")
    parser.add_argument("--collectors", default=",".join(COLLECTORS), help="which, comma-separated")
    parser.add_argument("--cases", default=",".join(CASES), help="cluster, processes or both")
    parser.add_argument(
        "--against", action="append", default=[], metavar="NAME=DIR",
        help="also run the instrumented kinds with the dask_otel in DIR",
    )  # fmt: skip
    parser.add_argument("--computations", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=5000)
    args = parser.parse_args()
    with socket.socket() as s:  # fail early without loopback
        s.bind(("127.0.0.1", 0))
    (memory if args.memory else timings)(args)


if __name__ == "__main__":
    main()
