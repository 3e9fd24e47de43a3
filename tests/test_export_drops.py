"""Lost spans and log records are counted (``dask_otel.exporter.dropped``) and said once.

The SDK loses telemetry in two places: a batch processor whose queue is full drops new
items, and an exporter that gave up returns FAILURE, which nobody reads. The processors
dask-otel configures count both.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from dask_otel.export import drops, processors


class FailingExporter(SpanExporter):
    """Fails every batch; blocks in the first one until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[int] = []

    def export(self, spans):
        self.batches.append(len(spans))
        if len(self.batches) == 1:
            self.entered.set()
            assert self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


@pytest.fixture
def fresh_warning(fresh_process):
    """Let this test's losses be reported as if for the first time in the process."""


def test_full_queue_and_failed_export_are_counted_and_said_once(monkeypatch, caplog, fresh_warning):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    exporter = FailingExporter()
    provider = TracerProvider()
    provider.add_span_processor(processors.span_processor(exporter))
    tracer = provider.get_tracer("test")
    before = drops.dropped()
    try:
        for _ in range(10):  # a full batch: the processor's thread takes it and blocks
            tracer.start_span("first").end()
        assert exporter.entered.wait(30)
        with caplog.at_level(logging.WARNING, logger="dask_otel.export.drops"):
            for _ in range(25):  # 10 fill the queue again, 15 find it full
                tracer.start_span("second").end()
            exporter.release.set()  # the first batch fails, then the queued one
            provider.force_flush()
            for _ in range(5):  # a failed export more: counted, not said again
                tracer.start_span("third").end()
            provider.force_flush()
    finally:
        exporter.release.set()
        provider.shutdown()

    lost = {k: v - before.get(k, 0) for k, v in drops.dropped().items() if v != before.get(k)}
    assert lost == {("traces", "queue_full"): 15, ("traces", "export_failed"): 10 + 10 + 5}
    assert exporter.batches == [10, 10, 5]
    warnings = [r for r in caplog.records if r.name == "dask_otel.export.drops"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith("dask-otel: spans lost: ")
    assert "15 because its export queue was full (raise OTEL_BSP_MAX_QUEUE_SIZE" in message
    assert "10 because the exporter gave up on a batch" in message


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DASK_RUN = """
import json, logging, time
from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk._logs import LogRecordProcessor

import dask_otel
from dask_otel.export import drops, processors
from dask_otel.distro import sdk
from distributed import Client, LocalCluster


class Ended(SpanProcessor):
    count = 0

    def on_end(self, span):
        if span.context.trace_flags.sampled:
            Ended.count += 1


class Emitted(LogRecordProcessor):
    count = 0

    def on_emit(self, record):
        Emitted.count += 1

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


logging.basicConfig(level=logging.WARNING)
dask_otel.instrument()  # configures the SDK from OTEL_*, as opentelemetry-instrument does
trace.get_tracer_provider().add_span_processor(Ended())
_logs.get_logger_provider().add_log_record_processor(Emitted())
with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                  dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
    assert client.gather(client.map(abs, range(-20, 0))) == list(range(20, 0, -1))
    logging.getLogger("user").warning("a log record")
# A flush stops waiting for a collector that does not answer: each failed batch is counted
# when its exporter gives up (the losses' own warning, and the exporters' retry warnings,
# are log records, lost in turn). Done when every record made is counted and nothing more
# came for a whole round, whose metric collection then saw every loss.
deadline = time.monotonic() + 60
previous = None
while time.monotonic() < deadline:
    trace.get_tracer_provider().force_flush()
    _logs.get_logger_provider().force_flush()
    metrics.get_meter_provider().force_flush()
    lost = drops.dropped()
    now = (Ended.count, Emitted.count, lost.get(("traces", "export_failed")),
           lost.get(("logs", "export_failed")))
    if now[:2] == now[2:] and now == previous:
        break
    previous = now
    time.sleep(0.2)
print(json.dumps({
    "spans": Ended.count,
    "log_records": Emitted.count,
    "dropped": {"/".join(k): v for k, v in drops.dropped().items()},
}), flush=True)
"""


def test_unreachable_collector_every_loss_counted_and_reported(receiver):
    """Traces and logs go to a closed port, metrics to the receiver: a real Dask run."""
    lost = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update(
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=lost,
        OTEL_EXPORTER_OTLP_LOGS_ENDPOINT=lost,
        OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=receiver.grpc_endpoint,
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_BLRP_SCHEDULE_DELAY="200",
        OTEL_METRIC_EXPORT_INTERVAL="600000",  # only the final, forced collection
        DASK_DISTRIBUTED__DIAGNOSTICS__NVML="False",
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DASK_RUN)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])

    # Every span and log record made was lost, and every one was counted as lost.
    assert result["spans"] >= 1 + 1 + 20  # compute, graph and task spans
    assert result["dropped"] == {
        "traces/export_failed": result["spans"],
        "logs/export_failed": result["log_records"],
    }
    # Said once per signal, whatever the number of failed batches.
    assert out.stderr.count("dask-otel: spans lost") == 1, out.stderr
    assert out.stderr.count("dask-otel: log records lost") == 1, out.stderr

    # The counter reached the (reachable) metrics backend, zeros included.
    points = receiver.wait_for(lambda r: r.metrics("dask_otel.exporter.dropped"), timeout=30)
    values = {
        (p["attributes"]["dask_otel.signal"], p["attributes"]["error.type"]): p["value"]
        for p in points
    }
    assert values == {
        ("traces", "export_failed"): result["spans"],
        ("logs", "export_failed"): result["log_records"],
        ("traces", "queue_full"): 0,
        ("logs", "queue_full"): 0,
    }
    (point,) = [p for p in points if p["attributes"]["dask_otel.signal"] == "traces"][:1]
    assert point["unit"] == "{item}"
    assert point["is_monotonic"] is True
    assert point["attributes"]["dask.cluster.id"].startswith("Scheduler-")
