"""``dask-otel demo``: a short, realistic Dask run with everything dask-otel records.

Starts a scheduler and two workers in processes of their own (``dask scheduler``,
``dask worker``), as on a real cluster, instruments them from a client with
:func:`dask_otel.instrument`, and runs :mod:`dask_otel.tools.demo_workload`.

Exports to ``OTEL_EXPORTER_OTLP_ENDPOINT`` when it is set, otherwise writes OTLP JSON
files (the collector's file exporter format) and ends with their summary; either way it
says what did not get out (:mod:`dask_otel.tools.demo_delivery`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from distributed import Client

import dask_otel
from dask_otel.environment import FILE_EXPORT_DIR
from dask_otel.tools import report, summary
from dask_otel.tools.demo_delivery import FLUSH_TIMEOUT, Delivery, flush_everywhere
from dask_otel.tools.demo_workload import SIZES, Size, Steps, compute

#: Exit code of a demo whose telemetry did not (all) reach the collector.
EXPORT_FAILED = 1

#: Worker settings of the demo: spill by the target only; no memory monitor, whose
#: process-wide thresholds would fire at once with limits this small.
WORKER_MEMORY = {
    "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.3",
    "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE": "False",
}
#: Longest wait for the cluster to start, and for its processes to exit after shutdown.
START_TIMEOUT = 60.0
STOP_GRACE = 20.0


# -- the cluster ---------------------------------------------------------------------------


class DemoError(Exception):
    """The demo cannot run: the message says why."""


class _Cluster:
    """A ``dask scheduler`` and a ``dask worker --nworkers 2`` in processes of their own.

    Their output goes to ``log``; :meth:`close` and :meth:`stop` wait for them to exit
    (they flush their telemetry on the way) and kill what is left after their grace.
    """

    def __init__(self, workdir: Path, size: Size, env: dict[str, str]) -> None:
        #: Where the scheduler writes its address.
        self.scheduler_file = workdir / "scheduler.json"
        #: The processes' combined stdout and stderr.
        self.log_path = workdir / "cluster.log"
        self._size = size
        #: Variables the processes get on top of this one's.
        self._env = env
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> str:
        """Start the processes; the scheduler's address."""
        dask = [sys.executable, "-m", "dask"]
        common = ["--host", "127.0.0.1", "--scheduler-file", str(self.scheduler_file),
                  "--no-dashboard"]  # fmt: skip
        env = {"DASK_OTEL__FLUSH_TIMEOUT": f"{FLUSH_TIMEOUT}s", **os.environ, **WORKER_MEMORY}
        env.update(self._env)
        memory = str(self._size.memory_limit)
        with self.log_path.open("ab") as log:
            self._spawn([*dask, "scheduler", "--port", "0", *common], env, log)
            self._spawn(
                [*dask, "worker", "--nworkers", "2", "--nthreads", "2", "--memory-limit", memory,
                 *common],
                env, log,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._processes):
                raise DemoError(f"a cluster process exited at start:\n{self._log_tail()}")
            try:
                return str(json.loads(self.scheduler_file.read_text())["address"])
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        raise DemoError(f"the scheduler did not start in {START_TIMEOUT:.0f} s")

    def _spawn(self, command: list[str], env: dict[str, str], log: Any) -> None:
        self._processes.append(
            subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        )

    def terminate(self) -> None:
        """Tell the processes to close (SIGTERM: Dask closes gracefully)."""
        for process in self._processes:
            if process.poll() is None:
                process.terminate()

    def stop(self, grace: float) -> None:
        """Give the processes ``grace`` seconds to exit (closing, they export what they
        hold), then kill what is left."""
        deadline = time.monotonic() + grace
        for process in self._processes:
            _wait_or_kill(process, deadline)

    def close(self, grace: float) -> None:
        """Close the workers, then the scheduler, each given ``grace`` seconds. Closed by
        the scheduler instead (``client.shutdown()``), Dask's workers race their Nannies
        and log ERRORs on most runs, plain Dask's too: ``Worker process died
        unexpectedly``, ``Failed to communicate with scheduler during heartbeat``; closed
        first, the workers leave the scheduler before it goes."""
        for process in reversed(self._processes):  # started scheduler first
            if process.poll() is None:
                process.terminate()
            _wait_or_kill(process, time.monotonic() + grace)

    def _log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def _wait_or_kill(process: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- where the telemetry goes ----------------------------------------------------------------


#: The cluster's processes write their metrics to files too (see :func:`_file_mode`).
CLUSTER_METRICS = {"OTEL_METRICS_EXPORTER": "otlp_json_file"}


def _file_mode(directory: Path) -> None:
    """Route every process of the demo to OTLP JSON files: spans and log records, and the
    cluster's metrics. The demo's own process exports no metrics (its one instrument,
    ``dask_otel.exporter.dropped``, the demo checks itself): their last collection would
    be written at its exit, after the summary has counted the files."""
    directory.mkdir(parents=True, exist_ok=True)
    for signal in ("traces", "metrics", "logs"):
        for old in directory.glob(f"{signal}-*.jsonl"):  # an earlier demo's files only
            old.unlink()
    os.environ[FILE_EXPORT_DIR] = str(directory)
    for signal in ("TRACES", "LOGS"):
        os.environ[f"OTEL_{signal}_EXPORTER"] = "otlp_json_file"
    os.environ["OTEL_METRICS_EXPORTER"] = "none"
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "2000")
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")


def unreachable(endpoint: str) -> str | None:
    """Why nothing accepts connections at the OTLP ``endpoint``, or None if something does."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    grpc = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc"
    try:
        port = parts.port or (4317 if grpc else 4318)
    except ValueError as e:
        return f"not an address ({e})"
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=2):
            return None
    except OSError as e:
        return e.strerror or str(e)


# -- the demo ------------------------------------------------------------------------------


def run(output: Path, size: str = "normal", out: TextIO = sys.stdout) -> int:
    """Run the demo; returns the process exit code."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    output = output.resolve()
    if endpoint:
        problem = unreachable(endpoint)
        if problem is not None:
            raise DemoError(
                f"no OTLP collector at {endpoint} ({problem}): the demo's telemetry would be "
                "lost, so it did not run. Start a collector (README: The local observability "
                "stack), or unset OTEL_EXPORTER_OTLP_ENDPOINT to write files instead."
            )
        out.write(f"dask-otel demo: exporting to {endpoint}\n")
    else:
        _file_mode(output)
        out.write(f"dask-otel demo: writing OTLP JSON files to {output}\n")
    with tempfile.TemporaryDirectory(prefix="dask-otel-demo-") as workdir:
        cluster = _Cluster(Path(workdir), SIZES[size], {} if endpoint else CLUSTER_METRICS)
        delivery = _run_workload(cluster, SIZES[size], out)
    if delivery.failed:
        out.write(
            f"\nExport to {endpoint or output} FAILED: {delivery.describe()}.\n"
            "Is the collector running and reachable from this machine?\n"
        )
        return EXPORT_FAILED
    if endpoint:
        out.write(
            "\nAll telemetry was exported. In your tracing backend (Jaeger, Tempo, ...), the"
            " service dask-client has one trace per step above (compute mean, ...), with"
            " dask-scheduler and dask-worker spans inside.\n"
        )
        return 0
    out.write("\n")
    report.render(summary.summarize(output), out)
    out.write(
        f"\nThe files are in {output}. Summarize them again with\n  dask-otel summarize {output}\n"
    )
    return 0


def _run_workload(cluster: _Cluster, size: Size, out: TextIO) -> Delivery:
    steps = Steps(out)
    steps.start("starting a scheduler and 2 workers, each in a process of its own")
    try:
        address = cluster.start()
        with Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=START_TIMEOUT)
            dask_otel.instrument(client)
            steps.done()
            compute(client, size, steps)
            steps.start("flushing telemetry and closing the cluster")
            delivery = flush_everywhere(client)
    except BaseException:
        cluster.terminate()
        cluster.stop(STOP_GRACE)
        raise
    # Once an export failed, what the processes still hold is lost: no need to wait.
    cluster.close(STOP_GRACE if not delivery.failed else 0.0)
    steps.done()
    return delivery
