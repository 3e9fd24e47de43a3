"""A collector that is down or hung never delays a stop, and never grows a process.

End to end, with real processes and real OTLP exporters against a closed port, a TCP
listener that never answers and a gRPC server that never answers, all on 127.0.0.1, and
``otel.flush-timeout`` raised to 60 s, so that only dask-otel's judgement of the collector
can end a wait early: a process exits, a Nanny's worker closes and a cluster restarts
without waiting for the exporters' retries (10 s a batch), no Nanny kills its worker for
dask-otel's sake, and each process says once on stderr what it could not export. The time
bounds are generous (a loaded 2-core machine); the times themselves are measured by
``benchmarks/outage.py``.

Unit tests of the export queue (bounded in bytes, flushes that stop waiting for a hung
exporter and keep waiting for a slow one) use exporters that block or sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import bin_path, otel_env, start_scheduler, start_worker
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.exceptions import MetricsTimeoutError
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from otlp_receiver import UNANSWERED, closed_port, unanswered

from dask_otel import runtime, runtime_state
from dask_otel.export import abandon, drops, metric_readers, processors

#: No stop waits for what the collector does not answer: well under this (before, a
#: 60 s flush timeout let a process wait out its exporters' retries, 10 s a batch).
BOUND = 15.0
#: Only dask-otel's judgement of the collector may end a wait before this.
PATIENT = {"DASK_OTEL__FLUSH_TIMEOUT": "60s"}
#: Nothing exported before the exit: its shutdown makes the first export.
UNTRIED = {
    "OTEL_BSP_SCHEDULE_DELAY": "600000",
    "OTEL_BLRP_SCHEDULE_DELAY": "600000",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
    "OTEL_METRICS_EXPORTER": "none",
}
#: What a Nanny logs when it kills a worker that did not close within its grace.
KILLED = "Worker process still alive after"


class Endpoint:
    """What ``otel_env`` needs: an OTLP/gRPC endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.grpc_endpoint = endpoint


def said_losses(stderr: str) -> list[re.Match]:
    return list(
        re.finditer(
            r"dask-otel: collector unreachable at (\S+): (\d+) spans(?:, (\d+) log records)? "
            r"not exported",
            stderr,
        )
    )


# -- a process's exit ---------------------------------------------------------------------

SCRIPT = """
import logging, sys, time
from opentelemetry import trace
import dask_otel

dask_otel.instrument()  # the SDK, configured from OTEL_* as opentelemetry-instrument does
tracer = trace.get_tracer("test")
for i in range(2000):  # each batch a 10 s wait for the exporter, were it waited on
    tracer.start_span(f"span {i}").end()
logging.getLogger("user").warning("a log record")
time.sleep(float(sys.argv[1]))  # 0: the exit makes the first export
print(time.time(), flush=True)
"""


@pytest.mark.parametrize("kind", UNANSWERED)
@pytest.mark.parametrize("tried", [False, True], ids=["first export at exit", "export failed"])
def test_exit_does_not_wait_for_the_collector_and_says_the_loss(kind, tried):
    with unanswered(kind) as endpoint:
        env = otel_env(Endpoint(endpoint), **PATIENT, **({} if tried else UNTRIED))
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, "1.5" if tried else "0"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        ended = time.time()
    assert out.returncode == 0, out.stderr
    exit_took = ended - float(out.stdout.split()[-1])
    when = "after a failed export" if tried else "first export"
    print(f"\n{kind}, {when}: exit {exit_took:.2f}s")
    assert exit_took < BOUND, out.stderr
    (said,) = said_losses(out.stderr)
    assert endpoint.endswith(said[1])
    assert int(said[2]) == 2000  # every span, whether its export failed or it was still queued
    assert said[3] is not None and int(said[3]) >= 1
    # Said once, by dask-otel: not by the exporters at each attempt (the program configured
    # no handler, and Python's last resort printed their lines on stderr).
    assert not re.search(r"Transient error|Failed to export|aborting retry", out.stderr), out.stderr


# -- a Nanny's worker, a cluster's restart ------------------------------------------------

CLIENT = """
import operator, sys
from distributed import Client
import dask_otel
with Client(sys.argv[1], timeout=30) as client:
    dask_otel.instrument(client)
    client.wait_for_workers(1, timeout=60)
    assert sum(client.gather(client.map(operator.add, range(300), range(300)))) == 300 * 299
"""


@pytest.mark.parametrize("kind", UNANSWERED)
def test_nanny_never_kills_its_worker_for_dask_otel(kind, processes):
    """SIGTERM to a ``dask worker``'s Nanny: it asks its worker to close and kills it
    after 4 s; dask-otel's flush must not be why."""
    with unanswered(kind) as endpoint:
        env = otel_env(Endpoint(endpoint), **PATIENT)
        address = start_scheduler(processes, env)
        worker = start_worker(processes, env, address, "w0")
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, address],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        time.sleep(1.5)  # the worker's exports of those 300 task spans fail or hang
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
        took = time.monotonic() - started
    log = processes.logs()
    print(f"\n{kind}: Nanny and worker exited {took:.2f}s after SIGTERM")
    assert KILLED not in log, log
    assert took < BOUND, log
    assert said_losses(log), log  # the worker's spans, not exported


RESTART = """
import json, operator, sys, time
from distributed import Client, LocalCluster
import dask_otel

dask_otel.instrument()
with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                  dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
    assert sum(client.gather(client.map(operator.add, range(300), range(300)))) == 300 * 299
    time.sleep(1.5)
    started = time.monotonic()
    client.restart()
    restart = time.monotonic() - started
    assert sum(client.gather(client.map(operator.add, range(30), range(30)))) == 30 * 29
    started = time.monotonic()
print(json.dumps({"restart": restart, "close": time.monotonic() - started}), flush=True)
"""


def test_restart_and_close_with_a_hung_collector():
    with unanswered("hung gRPC") as endpoint:
        out = subprocess.run(
            [sys.executable, "-c", RESTART],
            env=otel_env(Endpoint(endpoint), **PATIENT),
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    times = json.loads(out.stdout.splitlines()[-1])
    print(f"\nhung gRPC: restart {times['restart']:.2f}s, close {times['close']:.2f}s")
    assert KILLED not in out.stderr, out.stderr
    assert times["restart"] < BOUND and times["close"] < BOUND, out.stderr


# -- the export queue ---------------------------------------------------------------------


class Blocking(SpanExporter):
    """Blocks in every export until released; counts what it was given."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.entered.set()
        self.release.wait(60)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


class Slow(SpanExporter):
    """Takes ``seconds`` per batch, and every batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.exported = 0

    def export(self, spans):
        time.sleep(self.seconds)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


@pytest.fixture
def fresh_health(fresh_process):
    """What other tests in this process saw of their collectors, and lost, does not count
    here; what this test loses is not counted for the others (the loss said once names the
    process's totals: test_export_drops checks them)."""


def traced(exporter, **options):
    processor = processors.span_processor(exporter, **options)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    return processor, provider.get_tracer("test")


def task_span(tracer, i: int) -> None:
    """A span shaped like a worker's ``task`` span (its key unique, as Dask's are)."""
    attributes = {
        "dask.task.key": f"('add-{i:032x}', {i})",
        "dask.task.prefix": "add",
        "dask.task.group": "add-0123456789abcdef",
        "dask.worker.address": "tcp://127.0.0.1:40000",
        "dask.cluster.id": "Scheduler-12345678-abcd",
        "dask.task.nbytes": 28,
        "thread.id": 140000000 + i,
    }
    span = tracer.start_span("task add", attributes=attributes)
    span.add_event("processing", {"dask.stimulus.id": f"compute-task-{i:016x}"})
    span.end()


@contextlib.contextmanager
def behind_a_stuck_export(**limits):
    """(exporter, processor, tracer) whose exporter has taken a first batch of 10 spans and
    blocks on it: what is traced next waits in the queue."""
    exporter = Blocking()
    processor, tracer = traced(exporter, max_export_batch_size=10, **limits)
    try:
        for i in range(10):
            task_span(tracer, i)
        assert exporter.entered.wait(30)
        yield exporter, processor, tracer
    finally:
        exporter.release.set()
        processor.shutdown()


def test_queue_is_bounded_in_bytes_and_counts_what_it_drops(fresh_health):
    with behind_a_stuck_export(max_queue_memory=100_000, max_queue_size=100_000) as (
        exporter,
        processor,
        tracer,
    ):
        for i in range(1000):
            task_span(tracer, i)
        queued = len(processor.export_queue)
        assert 0 < processor.export_queue.bytes <= 100_000
        assert 40 < queued < 1000  # about 1.4 kB a span
        assert drops.dropped()[("traces", "queue_full")] == 1000 - queued
    assert exporter.exported == 10 + queued


def test_queue_memory_0_bounds_the_queue_in_items_only(fresh_health):
    """``otel.max-queue-memory: 0`` is no bound in bytes (README), not room for nothing."""
    with behind_a_stuck_export(max_queue_memory=0, max_queue_size=100) as (_, processor, tracer):
        for i in range(150):
            task_span(tracer, i)
        assert len(processor.export_queue) == 100
        assert drops.dropped()[("traces", "queue_full")] == 50


ESTIMATE = """
import gc, json, sys, tracemalloc
sys.path.insert(0, sys.argv[1])
from test_outage import Blocking, task_span, traced

exporter = Blocking()
processor, tracer = traced(exporter, max_queue_size=10_000, max_export_batch_size=10_000,
                           schedule_delay_millis=600_000, max_queue_memory=2**30)
gc.collect()
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
for i in range(2000):
    task_span(tracer, i)
gc.collect()
held = tracemalloc.get_traced_memory()[0] - before
print(json.dumps([len(processor.export_queue), processor.export_queue.bytes, held]))
"""


def test_queued_size_estimate_is_close_to_the_memory_held():
    """In a process of its own: nothing else allocates while ``tracemalloc`` counts."""
    out = subprocess.run(
        [sys.executable, "-c", ESTIMATE, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    queued, estimated, held = json.loads(out.stdout.splitlines()[-1])
    assert queued == 2000
    print(f"\nestimated {estimated / 2000:.0f} B a span, held {held / 2000:.0f} B")
    assert 0.8 < estimated / held < 2.0  # an estimate on the safe side, of the right size


def test_flush_stops_waiting_for_an_exporter_that_hangs(fresh_health):
    exporter = Blocking()
    processor, tracer = traced(exporter, schedule_delay_millis=60_000)
    try:
        task_span(tracer, 0)
        assert processor.force_flush(30_000) is False  # gave up, the export still hangs
        assert exporter.exported == 0
        assert runtime.health.failing()
        task_span(tracer, 1)
        assert processor.force_flush(30_000) is False  # at once: one is stuck already
        exporter.release.set()  # the collector answers: the next flush waits again
        deadline = time.monotonic() + 30
        while runtime.health.stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert processor.force_flush(30_000) is True
        assert exporter.exported == 2
    finally:
        exporter.release.set()
        processor.shutdown()


def test_a_flush_stops_waiting_once_the_collector_refused_an_attempt(fresh_health):
    """The real OTLP/gRPC exporter against a closed port: its first attempt is refused at
    once, and the flush stops waiting then, not after giving a collector that has said
    nothing yet ``STALL``, nor one that may be back ``GRACE``, nor the exporter's retries."""
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{closed_port()}", insecure=True)
    processor, tracer = traced(exporter, schedule_delay_millis=60_000)
    try:
        task_span(tracer, 0)
        started = time.monotonic()
        assert processor.force_flush(30_000) is False
        took = time.monotonic() - started
        assert runtime.health.failing()
        assert took < runtime_state.GRACE, took
    finally:
        processor.shutdown()


def test_flush_keeps_waiting_while_batches_go_through(fresh_health):
    """Six batches of 0.2 s each: longer than a collector may stay silent, but each one
    answers in time."""
    exporter = Slow(0.2)
    processor, tracer = traced(exporter, max_export_batch_size=10, schedule_delay_millis=60_000)
    try:
        for i in range(55):
            task_span(tracer, i)
        assert processor.force_flush(30_000) is True
        assert exporter.exported == 55
        assert not runtime.health.failing()
    finally:
        processor.shutdown()


class TimingOut(InMemoryMetricReader):
    """A reader whose collection outlasts its timeout, as on a loaded machine."""

    def collect(self, timeout_millis: float = 10_000) -> None:
        raise MetricsTimeoutError("Timed out while flushing metric readers")


def test_a_flush_that_raises_prints_no_traceback(monkeypatch):
    """The SDK's ``MeterProvider.force_flush`` raises when a reader's collection times
    out: the flush's thread keeps it off stderr (the exception goes to the debug log)."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    meter_provider = MeterProvider(metric_readers=[TimingOut()])
    try:
        providers = runtime.Providers(TracerProvider(), meter_provider, LoggerProvider())
        assert runtime.flush(providers, 10) is True
    finally:
        meter_provider.shutdown()
    assert raised == []


def new_export_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("dask-otel")]


def test_the_export_thread_runs_only_while_spans_wait(fresh_health):
    """None before the first span (a process that never records runs none) and none once
    the queue is empty (a closed cluster leaves none behind: distributed's tests compare
    the threads before and after each); the span that started it is exported on schedule,
    and so is the next one, which starts another."""
    before = set(threading.enumerate())
    exporter = Slow(0)
    processor, tracer = traced(exporter, schedule_delay_millis=50)
    try:
        assert new_export_threads(before) == []
        task_span(tracer, 0)
        (thread,) = new_export_threads(before)
        thread.join(30)
        assert not thread.is_alive() and exporter.exported == 1
        task_span(tracer, 1)
        (thread,) = new_export_threads(before)
        thread.join(30)
        assert not thread.is_alive() and exporter.exported == 2
    finally:
        processor.shutdown()


def test_a_batch_goes_out_on_the_schedule_a_waiting_thread_would_have_kept(fresh_health):
    """The thread starts with the first item, but the batch is due when it would have been
    with a thread waiting since the queue was made (or its last export): at the next tick
    of ``delay``, not a whole ``delay`` after the item (a short script learns as early as
    before that its collector is down)."""
    processor, _ = traced(Slow(0), schedule_delay_millis=1000)
    queue = processor.export_queue
    try:
        began = queue.schedule_began
        # Idle for 2.25 delays: the next tick is 0.75 s away.
        assert queue.next_export_due(began + 2.25) - began == pytest.approx(3.0)
    finally:
        processor.shutdown()


def test_a_forked_child_forgets_its_parents_queue_and_exports(fresh_health):
    """A child forked while its parent's export hangs (a Nanny's worker started with
    ``fork``): it neither waits for the parent's export nor sends the parent's spans."""
    exporter = Blocking()
    processor, tracer = traced(exporter, max_export_batch_size=1, schedule_delay_millis=60_000)
    task_span(tracer, 0)
    assert exporter.entered.wait(30)
    task_span(tracer, 1)  # queued behind the hung export
    time.sleep(runtime_state.STALL + 0.1)
    assert runtime.health.patience() == 0  # the parent's export is stuck
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            exporter.release.set()  # this process's exports go through
            exporter.exported = 0
            queued = len(processor.export_queue)
            patience = runtime.health.patience()
            task_span(tracer, 2)
            flushed = processor.force_flush(10_000)
            os.write(write, json.dumps([queued, patience, flushed, exporter.exported]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as result:
        queued, patience, flushed, exported = json.loads(result.read())
    os.waitpid(pid, 0)
    exporter.release.set()
    processor.shutdown()
    assert [queued, patience, flushed, exported] == [0, runtime_state.STALL, True, 1]


def test_queue_memory_setting_reaches_the_configured_processors():
    code = textwrap.dedent(
        """
        import json
        from opentelemetry import _logs, trace
        from dask_otel.export import drops, processors, queues
        from dask_otel.distro import sdk
        sdk.configure("worker")  # before Dask is imported, as opentelemetry-instrument does
        import dask
        (spans,) = trace.get_tracer_provider()._active_span_processor._span_processors
        (logs,) = _logs.get_logger_provider()._multi_log_record_processor._log_record_processors
        print(json.dumps([spans.export_queue.max_bytes, logs.export_queue.max_bytes]))
        """
    )
    env = otel_env(Endpoint("http://127.0.0.1:9"), DASK_OTEL__MAX_QUEUE_MEMORY="123kB")
    env.update(OTEL_METRICS_EXPORTER="none")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [123_000, 123_000]


def test_a_worker_keeps_no_more_than_its_queue_memory_while_the_collector_is_down():
    """Real exports to a closed port from an in-process cluster: the span queue stops
    at ``otel.max-queue-memory`` and counts the rest as dropped."""
    code = textwrap.dedent(
        """
        import json, operator
        from distributed import Client, LocalCluster
        import dask_otel
        from dask_otel.export import drops, processors, queues
        from dask_otel.distro import sdk
        dask_otel.instrument()
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            for i in range(5):
                futures = client.map(operator.add, range(500), range(500), key=[
                    f"add{i}-{j}" for j in range(500)])
                client.gather(futures)
                del futures
            queued = [q.bytes for q in list(queues.export_queues) if q.signal == "traces"]
            print(json.dumps({"queued": queued, "dropped": drops.dropped().get(
                ("traces", "queue_full"), 0)}), flush=True)
        """
    )
    with unanswered("down") as endpoint:
        env = otel_env(Endpoint(endpoint), DASK_OTEL__MAX_QUEUE_MEMORY="200kB")
        env.update(OTEL_BSP_SCHEDULE_DELAY="60000")  # nothing leaves the queue on schedule
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    (queued,) = result["queued"]
    assert 0 < queued <= 200_000
    assert result["dropped"] > 1000  # 2,500 tasks: a task and an execute span each


# -- no thread before use, none after -----------------------------------------------------

LEAK_CHECK = """
import operator, threading
from distributed import Client, LocalCluster
from distributed.utils_test import check_thread_leak
import dask_otel

def compute():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        assert client.submit(operator.add, 1, 2, key="add-1").result() == 3

compute()  # plain: Dask's own threads that outlive a cluster (its offload thread) start
dask_otel.instrument()  # the SDK, configured from OTEL_* as opentelemetry-instrument does
print(sorted(t.name for t in threading.enumerate() if "otel" in t.name.lower()), flush=True)
with check_thread_leak():  # distributed's own check, as its tests run it
    compute()
"""


def test_a_closed_cluster_leaves_no_export_thread_behind(receiver):
    """An instrumented process starts its export threads when it first records, and a
    cluster's close ends them: distributed's check that a test leaked no thread passes."""
    env = otel_env(receiver)
    for name in ("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BLRP_SCHEDULE_DELAY"):
        del env[name]  # the SDK's schedule (5 s, 1 s), as distributed's tests run instrumented
    out = subprocess.run(
        [sys.executable, "-c", LEAK_CHECK], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]", out.stdout  # none before the cluster
    receiver.wait_for(lambda rx: rx.spans())  # recorded, and exported


USER_METER = """
import sys
from opentelemetry import metrics
metrics.get_meter("user").create_counter("user.count").add(1)
sys.stdin.read()  # until the test saw the point
"""


#: The same meter made before the program configures the SDK with ``dask_otel.instrument``.
USER_METER_FIRST = """
import sys
from opentelemetry import metrics
counter = metrics.get_meter("user").create_counter("user.count")
import dask_otel
dask_otel.instrument()
counter.add(1)
sys.stdin.read()  # until the test saw the point
"""


@pytest.mark.parametrize(
    "command",
    [[bin_path("opentelemetry-instrument"), sys.executable, "-c", USER_METER],
     [sys.executable, "-c", USER_METER_FIRST]],
    ids=["opentelemetry-instrument", "meter-before-instrument"],
)  # fmt: skip
def test_a_users_metrics_are_exported_on_schedule_without_dask(receiver, command):
    """A process that makes its own meter gets its metrics exported every
    ``OTEL_METRIC_EXPORT_INTERVAL`` (1 s here), not only at its exit: also a meter made
    before the SDK was configured."""
    env = otel_env(receiver, OTEL_METRICS_EXPORTER="otlp")
    with subprocess.Popen(
        command,
        env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as process:  # fmt: skip
        try:
            receiver.wait_for(lambda rx: rx.metrics("user.count"), timeout=60)
        finally:
            process.communicate("", timeout=60)
    assert process.returncode == 0


class ChannelClosed(MetricExporter):
    """A metric exporter whose call finds its channel closed, as one the abandon logic cut
    does (gRPC raises ``ValueError: Cannot invoke RPC on closed channel!``)."""

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        raise ValueError("Cannot invoke RPC on closed channel!")

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


class Server:
    """Holds the metric demand as a Dask server does, from its start to its close."""


def test_a_metric_export_cut_while_exports_are_given_up_fails_quietly(fresh_process):
    """Once exports are given up (the collector down, nothing of Dask's running here), a
    metric export whose channel was closed under it fails without raising: the SDK's
    reader logged it with a traceback on a closing scheduler's stderr
    (tests/test_faults.py::test_collector_unreachable_from_the_start). Before that, the
    error is the exporter's to raise."""
    server = Server()
    runtime.metric_demand.hold(server, lambda held: True)
    runtime.metric_demand.release(server)
    watched = metric_readers._WatchedMetricExporter(ChannelClosed(), reader=None)
    with pytest.raises(ValueError):
        watched.export(None)
    runtime.health.attempt_failed()
    assert abandon.abandoned()
    assert watched.export(None) == MetricExportResult.FAILURE
