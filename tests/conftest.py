"""Shared fixtures: in-memory providers for unit tests, real processes for end-to-end."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_receiver import OTLPReceiver, exporting_env

import dask_otel
from dask_otel import runtime, strings

HERE = Path(__file__).parent


def metrics_by_name(metrics_data) -> dict:  # type: ignore[no-untyped-def]
    """The SDK's metrics of one collection (``MetricsData``, or None: nothing), by name."""
    if metrics_data is None:
        return {}
    return {
        metric.name: metric
        for resource_metrics in metrics_data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    }


class RecordingMetricExporter(MetricExporter):
    """Keeps the points of every export, by instrument name: what a collector got, also
    from servers that have closed since (the SDK lets their series go after)."""

    def __init__(self) -> None:
        super().__init__()
        self.exports: list[dict[str, list]] = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):  # type: ignore[no-untyped-def]
        found = metrics_by_name(metrics_data)
        self.exports.append({name: list(m.data.data_points) for name, m in found.items()})
        return MetricExportResult.SUCCESS

    def points(self, name: str) -> list:
        """Every exported point of instrument ``name``."""
        return [point for export in self.exports for point in export.get(name, [])]

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:  # type: ignore[no-untyped-def]
        pass


class Telemetry:
    """In-memory exporters behind the providers given to DaskInstrumentor."""

    def __init__(self) -> None:
        self.span_exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))
        self.log_exporter = InMemoryLogRecordExporter()
        self.logger_provider = LoggerProvider()
        self.logger_provider.add_log_record_processor(SimpleLogRecordProcessor(self.log_exporter))
        self.metric_reader = InMemoryMetricReader()
        #: Exports only when flushed (a close, a test): every export kept.
        self.metric_exporter = RecordingMetricExporter()
        self.meter_provider = MeterProvider(
            metric_readers=[
                self.metric_reader,
                PeriodicExportingMetricReader(
                    self.metric_exporter, export_interval_millis=3_600_000
                ),
            ]
        )

    def spans(self, prefix: str = "") -> list:
        return [s for s in self.span_exporter.get_finished_spans() if s.name.startswith(prefix)]

    def logs(self) -> list:
        return [r.log_record for r in self.log_exporter.get_finished_logs()]


@pytest.fixture(autouse=True)
def redaction_restored() -> Iterator[None]:
    """``otel.redact.*`` is process state, set as components activate (and read by the
    exporters dask-otel configures): a test that turns it on leaves it as it found it."""
    saved = dataclasses.replace(strings.redaction)
    yield
    strings.redaction.exception_messages = saved.exception_messages
    strings.redaction.log_bodies = saved.log_bodies


@pytest.fixture
def fresh_process() -> Iterator[None]:
    """What this process counted and said before does not count in this test, nor what
    the test counts and says in the others (the loss said once names the totals)."""
    runtime.reset()
    yield
    runtime.reset()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """DaskInstrumentor active with in-memory providers; uninstrumented afterwards."""
    with instrumented() as t:
        yield t


@contextmanager
def instrumented() -> Iterator[Telemetry]:
    """DaskInstrumentor active with in-memory providers in this block."""
    t = Telemetry()
    dask_otel.DaskInstrumentor().instrument(
        tracer_provider=t.tracer_provider,
        meter_provider=t.meter_provider,
        logger_provider=t.logger_provider,
    )
    try:
        yield t
    finally:
        dask_otel.DaskInstrumentor().uninstrument()
        t.tracer_provider.shutdown()
        t.logger_provider.shutdown()
        t.meter_provider.shutdown()


@contextmanager
def in_process_cluster(n_workers: int = 2, **kwargs) -> Iterator[Client]:
    """A client of a LocalCluster in this process (one thread per worker, loopback only);
    ``processes=True, host="127.0.0.1"``: its workers in processes of their own."""
    options = {"threads_per_worker": 1, "processes": False, "dashboard_address": "127.0.0.1:0"}
    with (
        LocalCluster(n_workers=n_workers, **{**options, **kwargs}) as cluster,
        Client(cluster) as client,
    ):
        yield client


def flush_emitters(client) -> None:
    """Wait until the scheduler and worker plugins emitted every span they recorded."""

    def flush(dask_scheduler=None, dask_worker=None) -> bool:
        plugin = (dask_scheduler or dask_worker).plugins.get("dask-otel")
        return plugin is None or plugin.flush(10)

    assert all(client.run(flush).values())
    assert client.run_on_scheduler(flush)


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as rx:
        yield rx


#: A test's processes export soon after they record.
QUICK_EXPORTS = {
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "OTEL_BLRP_SCHEDULE_DELAY": "200",
    "OTEL_METRIC_EXPORT_INTERVAL": "1000",
}


def otel_env(rx: OTLPReceiver, protocol: str = "grpc", **extra: str) -> dict[str, str]:
    """Environment of a process that exports everything to ``rx`` quickly."""
    endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
    return exporting_env(endpoint, protocol, **{**QUICK_EXPORTS, **extra})


def bin_path(name: str) -> str:
    """A console script installed next to this interpreter."""
    return str(Path(sys.executable).with_name(name))


class Processes:
    """Starts real processes and stops every one of them (SIGTERM, then SIGKILL)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, args: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        log = self.tmp_path / f"{name}.log"
        proc = subprocess.Popen(
            args,
            # The test's own temporary directory: its Nannies find no flight recorders that
            # an earlier test's dead workers left (a Nanny sends those on, as on a machine).
            env={**env, "TMPDIR": str(self.tmp_path)},
            cwd=self.tmp_path,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"==== {log.name}\n{log.read_text()}" for _, log in self.procs)

    def stop(self, proc: subprocess.Popen, timeout: float = 20) -> int:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            self.stop(proc)
            # Nanny children live in the same session; make sure none is left.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def processes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(procs.logs())


#: Fixtures that make a test end-to-end: real processes, or the real OTLP exporters into a
#: receiver on 127.0.0.1.
E2E_FIXTURES = frozenset({"processes", "receiver"})
#: What a test's source, or that of a helper it calls, calls to start a Dask cluster or
#: another process, or to export over OTLP.
E2E_CALLS = (
    "in_process_cluster(",
    "LocalCluster(",
    "gen_cluster",
    "subprocess",
    "Client(",
    "fork(",
    # a real OTLP exporter, or a server on 127.0.0.1 for one to export to
    "OTLPSpanExporter(",
    "OTLPLogExporter(",
    "OTLPMetricExporter(",
    "OTLPReceiver(",
    "StalledCollector(",
)


def _end_to_end(item: pytest.Item) -> bool:
    if E2E_FIXTURES & set(getattr(item, "fixturenames", ())) or "e2e" in item.path.stem:
        return True
    return _reaches_out(getattr(item, "function", None), helpers=True)


def _reaches_out(function: object, helpers: bool) -> bool:
    """Whether ``function``'s source, or with ``helpers`` that of a function it calls by
    name (``run_demo(...)``, say), starts a cluster or a process or exports over OTLP."""
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    if any(call in source for call in E2E_CALLS):
        return True
    names = getattr(function, "__globals__", {})
    called = {names.get(name) for name in re.findall(r"\b(\w+)\(", source)}
    return helpers and any(
        _reaches_out(helper, helpers=False)
        for helper in called
        if inspect.isfunction(helper) and helper is not function
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that start clusters or processes, or export over OTLP, ``e2e``:
    ``pytest -m "not e2e"`` is the quick unit run."""
    for item in items:
        if _end_to_end(item):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def wait_for_file(path: Path, procs: Processes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared\n{procs.logs()}")
        time.sleep(0.1)


def scheduler_address(path: Path, procs: Processes, timeout: float = 60) -> str:
    """The address in a scheduler file, once Dask has written all of it (it appears
    empty first: reading it then fails the test now and then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(path.read_text())["address"]
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise AssertionError(f"no address in {path}\n{procs.logs()}") from None
            time.sleep(0.1)


#: Command-line options of a Dask server that loads dask-otel by Dask's own mechanism.
PRELOAD = ("--preload", "dask_otel")


def start_scheduler(
    procs: Processes,
    env: dict[str, str],
    instrumented: bool = True,
    name: str = "scheduler",
    options: tuple[str, ...] = (),
) -> str:
    """A ``dask scheduler`` process on 127.0.0.1 (under ``opentelemetry-instrument`` when
    ``instrumented``), with more command-line ``options``; returns its address once it
    is up."""
    scheduler_file = procs.tmp_path / f"{name}.json"
    command = [bin_path("dask"), "scheduler", "--host", "127.0.0.1", "--port", "0"]
    command += ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]  # HTTP routes stay
    command += ["--scheduler-file", str(scheduler_file), *options]
    if instrumented:
        command = [bin_path("opentelemetry-instrument"), *command]
    procs.start(command, env, name)
    return scheduler_address(scheduler_file, procs)


def start_worker(
    procs: Processes,
    env: dict[str, str],
    address: str,
    name: str,
    instrumented: bool = True,
    nanny: bool = True,
    options: tuple[str, ...] = (),
) -> subprocess.Popen:
    """A one-thread ``dask worker`` process called ``name`` (with a Nanny unless told),
    with more command-line ``options``."""
    command = [bin_path("dask"), "worker", address, "--host", "127.0.0.1", "--nthreads", "1"]
    command += ["--no-dashboard", "--name", name, *([] if nanny else ["--no-nanny"]), *options]
    if instrumented:
        command = [bin_path("opentelemetry-instrument"), *command]
    return procs.start(command, env, name)


OTEL = bin_path("opentelemetry-instrument")


def start_cluster(processes, env, worker_commands):
    """A ``dask-scheduler`` process and one worker per command of ``worker_commands``
    (``[bin_path("dask-worker")]``, say), all under ``opentelemetry-instrument``; the
    scheduler's address once it is up."""
    scheduler_file = processes.tmp_path / "scheduler.json"
    processes.start(
        [
            OTEL,
            bin_path("dask-scheduler"),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
        ],
        env,
        "scheduler",
    )
    wait_for_file(scheduler_file, processes)
    for i, command in enumerate(worker_commands):
        processes.start(
            [
                OTEL,
                *command,
                "--scheduler-file",
                str(scheduler_file),
                "--host",
                "127.0.0.1",
                "--nthreads",
                "1",
                "--no-dashboard",
                "--name",
                f"w{i}",
            ],
            env,
            f"worker{i}",
        )
    return scheduler_address(scheduler_file, processes)


def run_client(processes, env, address, *args, script="workload.py"):
    """Run a client script of tests/scripts under opentelemetry-instrument: (JSON, stderr)."""
    out = subprocess.run(
        [OTEL, sys.executable, str(HERE / "scripts" / script), address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=processes.tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr + processes.logs()
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr
