"""Logs: records from tasks and from Dask, stamped and correlated; scheduler events."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
from _pytest.logging import LogCaptureHandler
from conftest import flush_emitters, in_process_cluster, instrumented
from distributed import Client, LocalCluster
from opentelemetry import trace
from opentelemetry.instrumentation.logging.handler import LoggingHandler
from opentelemetry.sdk._logs import LoggerProvider

from dask_otel.signals import log_records, logs


def log_marker(x: int) -> int:
    logging.getLogger("user.code").warning("marker %d", x)
    return x


def fail(x: int) -> int:
    raise ValueError(f"broken {x}")


@pytest.fixture
def cluster_client(telemetry):
    with in_process_cluster() as client:
        yield client


def records(telemetry, predicate):
    return [r for r in telemetry.logs() if predicate(r)]


def test_task_log_record_carries_task_and_span(telemetry, cluster_client):
    client = cluster_client
    future = client.submit(log_marker, 5)
    assert future.result() == 5
    flush_emitters(client)
    (record,) = records(telemetry, lambda r: r.body == "marker 5")
    (execute,) = telemetry.spans("task log_marker")
    assert record.span_id == execute.context.span_id
    assert record.trace_id == execute.context.trace_id
    assert record.attributes["dask.task.key"] == future.key
    assert record.attributes["dask.cluster.id"] == client.scheduler_info()["id"]
    assert record.attributes["dask.worker.address"] == execute.attributes["dask.worker.address"]
    assert record.severity_text == "WARN"
    assert not [name for name in record.attributes if name.startswith("_")]


def test_compute_failed_record_is_correlated_and_described(telemetry, cluster_client):
    client = cluster_client
    future = client.submit(fail, 3)
    with pytest.raises(ValueError, match="broken 3"):
        future.result()
    flush_emitters(client)
    (record,) = records(telemetry, lambda r: str(r.body).startswith("Compute Failed"))
    (execute,) = telemetry.spans("attempt fail")
    assert record.severity_text == "ERROR"
    assert (record.trace_id, record.span_id) == (
        execute.context.trace_id,
        execute.context.span_id,
    )
    assert record.attributes["exception.type"] == "ValueError"
    assert "broken 3" in record.attributes["exception.message"]
    assert "in fail" in record.attributes["exception.stacktrace"]
    assert record.attributes["dask.task.key"] == future.key


def log_badly(x: int) -> int:
    logging.getLogger("user.code").warning("%d items", "not a number")
    return x


def test_a_record_that_cannot_be_formatted_fails_no_task(telemetry, cluster_client, monkeypatch):
    """As with plain logging, a bad format string is never raised into the task that
    logged it; the record is exported, its message unformatted."""
    root = logging.getLogger()
    # pytest's own capturing handlers raise what they cannot format: not what users run.
    kept = [h for h in root.handlers if not isinstance(h, LogCaptureHandler)]
    monkeypatch.setattr(root, "handlers", kept)
    assert cluster_client.submit(log_badly, 7).result() == 7
    (record,) = records(telemetry, lambda r: "items" in str(r.body))
    assert record.body == "'%d items' % ('not a number',)"


#: A process that logs a record Dask's stderr handler cannot format; ``--instrument``:
#: with dask-otel exporting logs to the console (stdout).
BAD_RECORD = textwrap.dedent(
    """
    import logging, sys
    if "--instrument" in sys.argv:
        import dask_otel
        dask_otel.instrument()
    import distributed  # its stderr handler on the "distributed" logger
    logging.getLogger("distributed").info("%d items", "x")
    """
)


def test_a_record_that_cannot_be_formatted_is_reported_once_as_plain():
    """Python reports the error once per handler that formats the record: dask-otel's
    export adds no report of its own, and exports the record, its message unformatted."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    runs = {
        way: subprocess.run(
            [sys.executable, "-c", BAD_RECORD, *args],
            env={**env, "OTEL_LOGS_EXPORTER": "console"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        for way, args in (("plain", []), ("instrumented", ["--instrument"]))
    }
    for out in runs.values():
        assert out.returncode == 0, out.stderr
        assert out.stderr.count("--- Logging error ---") == 1, out.stderr
    exported = json.loads(runs["instrumented"].stdout[runs["instrumented"].stdout.index("{") :])
    assert exported["body"] == "'%d items' % ('x',)"


def test_uninstall_puts_back_what_another_library_wrapped():
    """dask-otel wraps the methods of other OpenTelemetry handlers it finds (the logging
    instrumentation's, on the root), and puts back what each handler object had."""
    handler, plain = LoggingHandler(), LoggingHandler()
    seen = []
    handler.emit = seen.append  # another library's wrapper, on this handler object
    root, other = logging.getLogger(), logging.getLogger("test.other")
    root.addHandler(handler)
    other.addHandler(plain)
    provider = LoggerProvider()
    try:
        logs.install(provider, ("test.other",), logging.INFO)
        handler.emit(logging.makeLogRecord({"msg": "through both"}))
        assert handler.emit is not seen.append and len(seen) == 1
        assert "emit" in vars(plain) and "_translate" in vars(plain)
        logs.uninstall()
        assert handler.emit == seen.append
        assert "emit" not in vars(plain) and "_translate" not in vars(plain)  # the class's
    finally:
        logs.uninstall()
        root.removeHandler(handler)
        other.removeHandler(plain)
        provider.shutdown()


def test_the_filter_keeps_no_record_alive():
    """A record's traceback holds its frames' locals (a task's data): the filter that
    exports each record once must not keep the last one alive."""
    record_filter = log_records.DaskRecordFilter()
    record = logging.LogRecord("user.code", logging.ERROR, __file__, 1, "failed", None, None)
    assert record_filter.filter(record)
    assert not record_filter.filter(record)  # seen by a second handler: exported once
    gone = weakref.ref(record)
    del record
    gc.collect()
    assert gone() is None


def test_a_process_that_outlives_its_cluster_no_longer_names_it(telemetry):
    with in_process_cluster() as client:
        cluster_id = client.scheduler_info()["id"]
        assert client.submit(log_marker, 1).result() == 1
        flush_emitters(client)
    logging.getLogger("user.code").warning("after the cluster")
    (during,) = records(telemetry, lambda r: r.body == "marker 1")
    (after,) = records(telemetry, lambda r: r.body == "after the cluster")
    assert during.attributes["dask.cluster.id"] == cluster_id
    assert "dask.cluster.id" not in after.attributes


def test_removed_worker_is_an_event_record(telemetry, cluster_client):
    client = cluster_client
    address = next(iter(client.scheduler_info()["workers"]))
    client.retire_workers([address])
    flush_emitters(client)
    removed = records(telemetry, lambda r: r.event_name == "dask.remove-worker")
    assert removed, sorted({r.event_name for r in telemetry.logs() if r.event_name})
    # Dask publishes it under the worker's topic and under "all": exported once.
    (record,) = removed
    assert record.attributes["dask.worker.address"] == address
    assert record.attributes["dask.cluster.id"] == client.scheduler_info()["id"]
    assert "all" in record.attributes["dask.event.topics"]
    assert record.body["action"] == "remove-worker"


def test_logs_can_be_switched_off(telemetry):
    import dask

    with (
        dask.config.set({"otel.logs.enabled": False}),
        LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(log_marker, 9).result() == 9
        flush_emitters(client)
    assert not records(telemetry, lambda r: r.body == "marker 9")


def test_events_published_in_one_tick_are_all_exported(telemetry, cluster_client):
    client = cluster_client

    def publish(dask_scheduler):
        dask_scheduler.log_event("my-topic", {"action": "first"})
        dask_scheduler.log_event("my-topic", {"action": "second"})
        dask_scheduler.log_event("stealing", {"action": "steal"})  # excluded by default

    client.run_on_scheduler(publish)
    flush_emitters(client)
    names = [r.event_name for r in telemetry.logs() if r.event_name]
    assert names.count("dask.first") == 1 and names.count("dask.second") == 1
    assert "dask.steal" not in names


def test_no_logger_gets_a_handler_and_uninstrument_puts_logging_back():
    """A handler on the root would make Python think logging is configured (no last
    resort, no basicConfig): the bridge is on no logger (tests/test_stderr.py runs it)."""
    before = logging.Logger.callHandlers
    with instrumented() as telemetry:
        with in_process_cluster(n_workers=1) as client:
            assert client.submit(log_marker, 4).result() == 4
            flush_emitters(client)
        for name in ("", "distributed", "user.code"):
            handlers = logging.getLogger(name or None).handlers
            assert not [h for h in handlers if type(h).__name__ == "LoggingHandler"]
        assert records(telemetry, lambda r: r.body == "marker 4")
    assert logging.Logger.callHandlers is before


def set_many_attributes(x: int) -> int:
    span = trace.get_current_span()
    for i in range(2_000):
        span.set_attribute(f"user.attribute.{i}", i)
    return x


def test_the_sdks_own_warnings_are_exported_sparingly(telemetry, cluster_client):
    """Each attribute over the SDK's limit makes it warn ("Attributes dict is full"):
    exported once, then once a minute with the count of those held back; Python logging's
    other handlers still see every one."""
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    sdk_logger = logging.getLogger("opentelemetry.attributes")
    sdk_logger.addHandler(handler)
    try:
        futures = cluster_client.map(set_many_attributes, range(4))
        assert cluster_client.gather(futures) == [0, 1, 2, 3]
        flush_emitters(cluster_client)
    finally:
        sdk_logger.removeHandler(handler)
    full = [
        r
        for r in telemetry.log_exporter.get_finished_logs()
        if str(r.log_record.body).startswith("Attributes dict is full")
    ]
    assert len(seen) > 1_000  # the SDK's own count, per attribute
    assert len(full) == 1
    assert full[0].instrumentation_scope.name == "opentelemetry.attributes"


def test_repeats_are_counted_when_the_window_is_over(monkeypatch):
    repeats = log_records.Repeats()
    clock = [1000.0]
    monkeypatch.setattr(log_records, "monotonic", lambda: clock[0])

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("opentelemetry.sdk", logging.WARNING, "f", 1, message, (), None)

    assert repeats.admit(record("full"))
    assert not any(repeats.admit(record("full")) for _ in range(9))
    assert repeats.admit(record("other"))
    clock[0] += log_records.Repeats.WINDOW
    later = record("full")
    assert repeats.admit(later)
    assert later.__dict__["dask_otel.log.repeated"] == 9
