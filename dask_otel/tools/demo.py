"""``dask-otel demo``: a short, realistic Dask run with everything dask-otel records.

Starts a scheduler and two workers in processes of their own (``dask scheduler``,
``dask worker``), as on a real cluster, instruments them from a client with
:func:`dask_otel.instrument`, and runs: a reduction that moves data between workers, a
persist that spills to disk and is read back, tasks that log, and a task that fails twice
(``retries=1``). Needs nothing but dask-otel's own dependencies (no numpy).

Exports to ``OTEL_EXPORTER_OTLP_ENDPOINT`` when it is set, otherwise writes OTLP JSON
files (the collector's file exporter format) and ends with their summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from dask import delayed
from distributed import Client

import dask_otel
from dask_otel import runtime
from dask_otel.distro.drops import NOUNS
from dask_otel.distro.sdk import FILE_EXPORT_DIR
from dask_otel.tools import report, summary

#: Exit code of a demo whose telemetry did not (all) reach the collector.
EXPORT_FAILED = 1


@dataclass(frozen=True)
class Size:
    """One workload size."""

    #: Blocks concatenated pairwise up a tree, then averaged: the data moves between workers.
    blocks: int
    block_bytes: int
    #: Blocks persisted: more than the workers' spill targets hold together.
    persisted: int
    persisted_bytes: int
    #: Memory limit per worker; it spills past 30% of it (its spill target).
    memory_limit: int


SIZES = {
    "normal": Size(16, 1_000_000, persisted=64, persisted_bytes=2**20, memory_limit=64 * 2**20),
    "small": Size(8, 250_000, persisted=32, persisted_bytes=2**20, memory_limit=32 * 2**20),
}
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
#: Longest wait for the processes' telemetry before the demo calls it lost, and the
#: ``otel.flush-timeout`` of its cluster's processes (unless set): what the demo makes is
#: exported in well under a second when the collector answers.
FLUSH_TIMEOUT = 3.0


# -- the workload: plain Python functions, run as Dask tasks ------------------------------


def random_block(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def concat(left: bytes, right: bytes) -> bytes:
    return left + right


def mean(data: bytes) -> float:
    return sum(data) / len(data)


def checksum(crcs: list[int]) -> int:
    return sum(crcs) % 2**32


def log_and_square(x: int) -> int:
    import logging

    logging.getLogger("dask_otel.tools.demo.task").warning("squaring %d inside a task", x)
    return x * x


def fail_always(x: int) -> int:
    raise ValueError(f"demo failure on input {x}")


def _tree(blocks: list[Any]) -> Any:
    """Concatenate ``blocks`` pairwise, level by level, into one."""
    while len(blocks) > 1:
        pairs = [delayed(concat)(a, b) for a, b in zip(blocks[::2], blocks[1::2], strict=False)]
        blocks = pairs + blocks[len(pairs) * 2 :]
    return blocks[0]


# -- the cluster ---------------------------------------------------------------------------


class DemoError(Exception):
    """The demo cannot run: the message says why."""


class _Cluster:
    """A ``dask scheduler`` and a ``dask worker --nworkers 2`` in processes of their own.

    Their output goes to ``log``; :meth:`stop` waits for both to exit (they flush their
    telemetry on the way) and kills what is left after :data:`STOP_TIMEOUT`.
    """

    def __init__(self, workdir: Path, size: Size) -> None:
        #: Where the scheduler writes its address.
        self.scheduler_file = workdir / "scheduler.json"
        #: The processes' combined stdout and stderr.
        self.log_path = workdir / "cluster.log"
        self._size = size
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> str:
        """Start the processes; the scheduler's address."""
        dask = [sys.executable, "-m", "dask"]
        common = ["--host", "127.0.0.1", "--scheduler-file", str(self.scheduler_file),
                  "--no-dashboard"]  # fmt: skip
        env = {"DASK_OTEL__FLUSH_TIMEOUT": f"{FLUSH_TIMEOUT}s", **os.environ, **WORKER_MEMORY}
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
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


# -- output ----------------------------------------------------------------------------------


class _Steps:
    """Prints each step of the demo and how long it took."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._started = 0.0

    def start(self, text: str) -> None:
        self._out.write(f"  {text} ...")
        self._out.flush()
        self._started = time.perf_counter()

    def done(self, detail: str = "") -> None:
        self._out.write(f" done in {time.perf_counter() - self._started:.1f} s{detail}\n")
        self._out.flush()


def _file_mode(directory: Path) -> None:
    """Route all three signals of every process of the demo to OTLP JSON files."""
    directory.mkdir(parents=True, exist_ok=True)
    for signal in ("traces", "metrics", "logs"):
        for old in directory.glob(f"{signal}-*.jsonl"):  # an earlier demo's files only
            old.unlink()
    os.environ[FILE_EXPORT_DIR] = str(directory)
    for signal in ("TRACES", "METRICS", "LOGS"):
        os.environ[f"OTEL_{signal}_EXPORTER"] = "otlp_json_file"
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


# -- telemetry accounting ------------------------------------------------------------------


#: What one process says of its exports: whether its flush finished, what its exporters
#: lost by (signal, reason), and the spans and log records they still hold by signal.
Report = tuple[bool, dict[tuple[str, str], int], dict[str, int]]


def _flush_and_count() -> Report:
    """In one process: export what it holds (bounded), then say how that went."""
    from dask_otel.distro import queues

    finished = runtime.flush(runtime.current(), FLUSH_TIMEOUT)
    held, dropped = queues.unexported()
    return finished, dropped, dict(held)


async def _flush_and_count_off_loop() -> Report:
    """:func:`_flush_and_count` for ``client.run``: never blocks the server's event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, _flush_and_count)


@dataclass
class _Delivery:
    """What every process of the demo says about its exports."""

    #: Processes whose flush did not finish in time.
    stalled: int = 0
    #: Items lost, by (signal, reason).
    lost: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Items the stalled processes still held, by signal: lost when the demo ends them.
    held: Counter[str] = field(default_factory=Counter)

    def add(
        self, finished: bool, dropped: dict[tuple[str, str], int], held: dict[str, int]
    ) -> None:
        self.stalled += not finished
        self.lost.update(dropped)
        if not finished:
            self.held.update(held)

    @property
    def failed(self) -> bool:
        return bool(self.stalled or any(self.lost.values()))

    def describe(self) -> str:
        lost = ", ".join(
            f"{count} {NOUNS.get(signal, signal)} ({reason.replace('_', ' ')})"
            for (signal, reason), count in sorted(self.lost.items())
            if count
        )
        parts = [f"lost: {lost}"] if lost else []
        if self.stalled:
            held = ", ".join(
                f"{count} {noun}" for signal, noun in NOUNS.items() if (count := self.held[signal])
            )
            parts.append(
                f"{self.stalled} process(es) could not finish exporting within "
                f"{FLUSH_TIMEOUT:.0f} s: what they still held "
                f"({held or 'no spans or log records'}) is lost too"
            )
        return "; ".join(parts)


def _delivery(client: Client) -> _Delivery:
    """Every process flushes at once (this one, the scheduler's, the workers')."""
    with ThreadPoolExecutor(3) as pool:
        here = pool.submit(_flush_and_count)
        scheduler = pool.submit(client.run_on_scheduler, _flush_and_count_off_loop)
        workers = pool.submit(client.run, _flush_and_count_off_loop)
        reports = [here.result(), scheduler.result(), *workers.result().values()]
    delivery = _Delivery()
    for finished, dropped, held in reports:
        delivery.add(finished, dropped, held)
    return delivery


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
        delivery = _run_workload(_Cluster(Path(workdir), SIZES[size]), SIZES[size], out)
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
        f"\nThe files are in {output}. Summarize them again with\n"
        f"  dask-otel summarize {output}\n"
        "Replay them into Jaeger or Tempo through a collector's otlpjsonfile receiver:\n"
        "  receivers: {otlpjsonfile: {include: ['" + str(output) + "/*.jsonl']}}\n"
    )
    return 0


def _run_workload(cluster: _Cluster, size: Size, out: TextIO) -> _Delivery:
    steps = _Steps(out)
    steps.start("starting a scheduler and 2 workers, each in a process of its own")
    try:
        address = cluster.start()
        with Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=START_TIMEOUT)
            dask_otel.instrument(client)
            steps.done()
            _compute(client, size, steps)
            steps.start("flushing telemetry and closing the cluster")
            delivery = _delivery(client)
            client.shutdown()
    except BaseException:
        cluster.terminate()
        cluster.stop(STOP_GRACE)
        raise
    # Once an export failed, what the processes still hold is lost: no need to wait.
    cluster.stop(STOP_GRACE if not delivery.failed else 0.0)
    steps.done()
    return delivery


def _compute(client: Client, size: Size, steps: _Steps) -> None:
    megabytes = size.blocks * size.block_bytes / 1e6
    steps.start(f"a reduction of {megabytes:.0f} MB in {size.blocks} blocks across workers")
    blocks = [delayed(random_block)(i, size.block_bytes) for i in range(size.blocks)]
    average = delayed(mean)(_tree(blocks)).compute()
    steps.done(f" (mean byte {average:.2f})")

    stored = size.persisted * size.persisted_bytes / 2**20
    steps.start(f"persisting {stored:.0f} MiB, more than the workers keep in memory")
    seeds = range(1000, 1000 + size.persisted)
    persisted = client.persist([delayed(random_block)(i, size.persisted_bytes) for i in seeds])
    total = delayed(checksum)([delayed(zlib.crc32)(b) for b in persisted]).compute()
    del persisted
    steps.done(f" (checksum {total})")

    steps.start("tasks that log")
    squares = client.gather(client.map(log_and_square, range(4)))
    steps.done(f" ({squares})")

    steps.start("a task that fails, with one retry")
    try:
        client.submit(fail_always, 42, retries=1).result()
    except ValueError as e:
        steps.done(f" (failed as planned: {e})")
