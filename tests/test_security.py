"""Security: what leaves a process, what never does, and what dask-otel never opens.

Exception messages and log bodies redacted by configuration (spans, log records, event
records), bodies capped; task arguments and results never exported; OTLP headers and TLS
through the standard ``OTEL_EXPORTER_OTLP_*`` settings, the token never logged; no
listening port besides Dask's own.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent import futures

import dask
import grpc
import psutil
import pytest
from conftest import flush_emitters, in_process_cluster, otel_env, start_scheduler, start_worker
from distributed import Client
from opentelemetry import trace
from opentelemetry._logs import LogRecord
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from otlp_receiver import OTLPReceiver, _LogsServicer, _MetricsServicer, _TraceServicer

from dask_otel.export import processors

SECRET = "SECRET-MSG-4711"
TOKEN = "s3cr3t"


def fail_with_secret(x: int) -> int:
    raise ValueError(f"{SECRET} {x}")


def log_failure(x: int) -> int:
    try:
        fail_with_secret(x)
    except ValueError:
        logging.getLogger("user.code").exception("handling %s failed", x)
    return x


def log_marker(x: int) -> int:
    logging.getLogger("user.code").warning("marker %s with %s", x, SECRET)
    return x


class Collect(logging.Handler):
    """Another handler on the same loggers, as Dask's stderr handler is."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def collect():
    handler = Collect()
    loggers = [logging.getLogger("user.code"), logging.getLogger("distributed.worker")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def publish_error_event(dask_scheduler) -> None:
    """What a worker that fails hard publishes (``distributed.core.error_message``)."""
    dask_scheduler.log_event(
        "worker-fail-hard",
        {
            "status": "error",
            "exception_text": f"ValueError('{SECRET}')",
            "traceback_text": f'  File "x.py", line 1, in f\n    {SECRET}\n',
            "detail": f"free text {SECRET}",
        },
    )


def everything(telemetry) -> str:
    """Every exported span and log record, as text."""
    spans = [s.to_json() for s in telemetry.span_exporter.get_finished_spans()]
    logs = [
        json.dumps([r.body, dict(r.attributes or {}), r.event_name, r.severity_text], default=repr)
        for r in telemetry.logs()
    ]
    return "\n".join(spans + logs)


# -- redaction ------------------------------------------------------------------------------


def test_exception_messages_are_redacted_everywhere(telemetry, collect):
    with (
        dask.config.set({"otel.redact.exception-messages": True}),
        in_process_cluster(n_workers=1) as client,
    ):
        with pytest.raises(ValueError, match=SECRET):  # the computation is unaffected
            client.submit(fail_with_secret, 1).result()
        assert client.submit(log_failure, 2).result() == 2
        client.run_on_scheduler(publish_error_event)
        flush_emitters(client)
    spans = telemetry.spans("task fail_with_secret") + telemetry.spans("attempt fail_with_secret")
    assert len(spans) == 2
    for span in spans:
        (event,) = [e for e in span.events if e.name == "exception"]
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "[redacted]"
        assert event.attributes["exception.stacktrace"] == "[redacted]"
        assert span.attributes["error.type"] == "ValueError"
    records = telemetry.logs()
    (failed,) = [r for r in records if str(r.body).startswith("Compute Failed")]
    assert failed.attributes["exception.type"] == "ValueError"
    assert failed.attributes["exception.message"] == "[redacted]"
    (handled,) = [r for r in records if str(r.body).startswith("handling 2 failed")]
    assert handled.attributes["exception.message"] == "[redacted]"
    assert handled.attributes["exception.stacktrace"] == "[redacted]"
    (event,) = [r for r in records if r.event_name == "dask.worker-fail-hard"]
    assert event.body["exception_text"] == event.body["traceback_text"] == "[redacted]"
    assert event.body["detail"] == f"free text {SECRET}"  # not an exception field
    text = everything(telemetry).replace(f"free text {SECRET}", "")
    assert SECRET not in text
    # Other handlers see the records as they were.
    assert any(SECRET in line for line in collect.lines if line.startswith("Compute Failed"))


def record_on_own_span(x: int) -> int:
    """Every way a task can put an exception on the span dask-otel made current for it,
    and an exception quoted in a log message."""
    span = trace.get_current_span()
    try:
        fail_with_secret(x)
    except ValueError as e:
        span.record_exception(e)
        span.add_event("exception", {"exception.type": "ValueError", "exception.message": str(e)})
        span.set_status(StatusCode.ERROR, f"failed: {e}")
    try:
        with trace.use_span(span):  # records the exception and describes it in the status
            fail_with_secret(x)
    except ValueError as e:
        logging.getLogger("user.code").warning("gave up on %s: %s", x, e)
    return x


def test_exceptions_a_task_records_on_its_span_or_logs_are_redacted(telemetry):
    with (
        dask.config.set({"otel.redact.exception-messages": True}),
        in_process_cluster(n_workers=1) as client,
    ):
        assert client.submit(record_on_own_span, 3).result() == 3
        flush_emitters(client)
    (span,) = telemetry.spans("task record_on_own_span")
    events = [e for e in span.events if e.name == "exception"]
    assert len(events) == 3
    for event in events:
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "[redacted]"
        assert event.attributes.get("exception.stacktrace", "[redacted]") == "[redacted]"
    assert span.status.description == "ValueError: [redacted]"
    # An exception quoted in a log message, not only one given as exc_info.
    assert "gave up on 3: ValueError: [redacted]" in [r.body for r in telemetry.logs()]
    assert SECRET not in everything(telemetry)


#: The user's own tracer inside tasks: set by the test (an in-process cluster).
user_tracer: trace.Tracer = trace.NoOpTracer()


def fail_in_own_span(x: int) -> int:
    """A span the task makes itself, which the SDK marks as failed on the way out."""
    try:
        with user_tracer.start_as_current_span("mine"):
            fail_with_secret(x)
    except ValueError:
        pass
    return x


def test_spans_and_records_a_task_makes_itself_are_redacted_on_export(telemetry, monkeypatch):
    """Spans and log records that dask-otel did not make, exported through the SDK as
    dask-otel configures it: their exception text is redacted too."""
    spans, records = InMemorySpanExporter(), InMemoryLogRecordExporter()
    tracer_provider, logger_provider = TracerProvider(), LoggerProvider()
    span_processor = processors.span_processor(spans)
    tracer_provider.add_span_processor(span_processor)
    log_processor = processors.log_record_processor(records)
    logger_provider.add_log_record_processor(log_processor)
    monkeypatch.setattr(sys.modules[__name__], "user_tracer", tracer_provider.get_tracer("user"))
    with (
        dask.config.set({"otel.redact.exception-messages": True}),
        in_process_cluster(n_workers=1) as client,
    ):
        assert client.submit(fail_in_own_span, 4).result() == 4
        logger_provider.get_logger("user").emit(
            LogRecord(body="by hand", attributes={"exception.message": SECRET})
        )
        assert span_processor.force_flush() and log_processor.force_flush()
    (mine,) = spans.get_finished_spans()
    assert mine.status.description == "ValueError: [redacted]"
    (event,) = mine.events
    assert event.attributes["exception.message"] == event.attributes["exception.stacktrace"]
    assert event.attributes["exception.message"] == "[redacted]"
    (record,) = [r.log_record for r in records.get_finished_logs()]
    assert record.attributes["exception.message"] == "[redacted]"
    tracer_provider.shutdown()
    logger_provider.shutdown()


def test_log_bodies_carry_the_template(telemetry, collect):
    with (
        dask.config.set({"otel.redact.log-bodies": True}),
        in_process_cluster(n_workers=1) as client,
    ):
        assert client.submit(log_marker, 5).result() == 5
        with pytest.raises(ValueError, match=SECRET):
            client.submit(fail_with_secret, 1).result()
        client.run_on_scheduler(publish_error_event)
        flush_emitters(client)
    records = telemetry.logs()
    (marker,) = [r for r in records if str(r.body).startswith("marker")]
    assert marker.body == "marker %s with %s"
    assert marker.attributes["dask.task.key"]  # the record keeps its other fields
    (failed,) = [r for r in records if str(r.body).startswith("Compute Failed")]
    assert failed.body.startswith("Compute Failed\nKey:       %s")
    (event,) = [r for r in records if r.event_name == "dask.worker-fail-hard"]
    assert event.body["detail"] == "[redacted]" and event.body["status"] == "[redacted]"
    # Only the exported copy changes: the stderr-like handler formats the real message.
    assert f"marker 5 with {SECRET}" in collect.lines


def test_defaults_redact_nothing(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(log_marker, 6).result() == 6
        client.run_on_scheduler(publish_error_event)
        flush_emitters(client)
    records = telemetry.logs()
    assert f"marker 6 with {SECRET}" in [r.body for r in records]
    (event,) = [r for r in records if r.event_name == "dask.worker-fail-hard"]
    assert SECRET in event.body["exception_text"]


def log_long(x: int) -> int:
    logging.getLogger("user.code").warning("x" * 100_000)
    return x


def test_log_and_event_bodies_are_capped(telemetry):
    with (
        dask.config.set({"otel.max-attribute-length": 32}),
        in_process_cluster(n_workers=1) as client,
    ):
        assert client.submit(log_long, 1).result() == 1
        with pytest.raises(ValueError):
            client.submit(fail_with_secret, "y" * 10_000).result()
        client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.log_event("mine", {"text": "z" * 10_000})
        )
        flush_emitters(client)
    records = telemetry.logs()
    (long,) = [r for r in records if str(r.body).startswith("xxx")]
    assert len(long.body) == 32 * 16
    (failed,) = [r for r in records if str(r.body).startswith("Compute Failed")]
    assert len(failed.body) <= 32 * 16
    assert len(failed.attributes["exception.message"]) <= 32 * 4
    (event,) = [r for r in records if r.event_name == "dask.mine"]
    assert len(event.body["text"]) == 32


# -- never task arguments or results --------------------------------------------------------

ARG = "SECRET-ARG-1234"
RESULT = "SECRET-RESULT-5678"


def echo(x: str) -> str:
    return f"{x}!"


def make_result(x: str) -> str:
    return RESULT


def fail_on(x: str) -> str:
    raise ValueError("no")


def log_own_words(x: str) -> str:
    logging.getLogger("user.code").warning("LOGGED-ON-PURPOSE")
    return x


def test_task_arguments_and_results_are_never_exported(telemetry):
    with in_process_cluster() as client:
        scattered = client.scatter(ARG)
        assert client.submit(echo, ARG).result() == f"{ARG}!"
        assert client.submit(echo, scattered).result() == f"{ARG}!"
        assert client.gather(client.map(make_result, [ARG, ARG + "2"])) == [RESULT] * 2
        assert dask.delayed(echo)(dask.delayed(make_result)(ARG)).compute() == f"{RESULT}!"
        with pytest.raises(ValueError):
            client.submit(fail_on, ARG).result()
        with pytest.raises(ValueError):  # Dask's "Compute Failed" prints this task's argument
            client.get({"literal": (fail_on, ARG)}, "literal")
        assert client.submit(log_own_words, ARG).result() == ARG
        flush_emitters(client)
        metrics = telemetry.metric_reader.get_metrics_data().to_json()
    text = everything(telemetry) + metrics
    assert "LOGGED-ON-PURPOSE" in text  # what the task itself logs is exported ...
    assert ARG not in text and RESULT not in text  # ... its arguments and results never


PASSWORD = "SECRET-PASSWORD-2718"


def connect(host: str, password: str | None = None, token: str | None = None) -> str:
    if host != "db":
        raise ConnectionError(f"cannot connect to {host}")
    return "connected"


@pytest.mark.parametrize("redact", [False, True])
def test_functions_run_with_client_run_and_their_arguments_are_never_exported(telemetry, redact):
    """``client.run`` and ``run_on_scheduler``: Dask's ``run-function`` event holds the
    pickled function (a ``functools.partial`` pickles its arguments), its ``Run Failed``
    records print the arguments; whatever the redaction settings, neither leaves."""
    with (
        dask.config.set({"otel.redact.exception-messages": redact}),
        in_process_cluster(n_workers=1) as client,
    ):
        bound = functools.partial(connect, password=PASSWORD)
        assert set(client.run(bound, "db").values()) == {"connected"}
        assert client.run_on_scheduler(bound, "db") == "connected"
        with pytest.raises(ConnectionError):
            client.run(connect, "elsewhere", password=PASSWORD)
        with pytest.raises(ConnectionError):
            client.run_on_scheduler(connect, "elsewhere", token=PASSWORD)
        flush_emitters(client)
        metrics = telemetry.metric_reader.get_metrics_data().to_json()
    records = telemetry.logs()
    events = [r for r in records if r.event_name == "dask.run-function"]
    assert len(events) >= 2  # flush_emitters runs one too
    assert all(r.body["function"] == "[redacted]" for r in events)
    failed = [r.body for r in records if str(r.body).startswith("Run Failed")]
    assert len(failed) == 2
    for body in failed:
        assert "Function: connect" in body  # its name, as in a task's prefix
        assert "args:     [redacted]" in body and "kwargs:   [redacted]" in body
    assert PASSWORD not in everything(telemetry) + metrics


# -- OTLP headers and TLS -------------------------------------------------------------------


class Collector:
    """An OTLP/gRPC collector on 127.0.0.1 (plain or TLS) that records request metadata.

    Decoding and storage come from :class:`OTLPReceiver` (not started itself).
    """

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.rx = OTLPReceiver()
        self.metadata: list[dict[str, str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        for servicer, add in [
            (_TraceServicer, trace_service_pb2_grpc.add_TraceServiceServicer_to_server),
            (_MetricsServicer, metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server),
            (_LogsServicer, logs_service_pb2_grpc.add_LogsServiceServicer_to_server),
        ]:
            add(self._recording(servicer)(self.rx), self.server)
        address = "127.0.0.1:0"
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        self.server.start()

    def _recording(self, servicer: type) -> type:
        collector = self

        class Recording(servicer):  # type: ignore[misc, valid-type]
            def Export(self, request, context):
                collector.metadata.append(dict(context.invocation_metadata()))
                return super().Export(request, context)

        return Recording

    def close(self) -> None:
        self.server.stop(grace=0).wait(5)


def test_otlp_headers_reach_the_collector_and_are_never_logged(caplog, tmp_path):
    collector = Collector()
    try:
        # In this process: every logger at DEBUG while the exporter works.
        caplog.set_level(logging.DEBUG)
        os.environ["OTEL_EXPORTER_OTLP_HEADERS"] = f"authorization=Bearer {TOKEN}"
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{collector.port}")
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_HEADERS"]
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        provider.get_tracer("t").start_span("with-token").end()
        provider.shutdown()
        assert collector.rx.spans("with-token")
        assert collector.metadata[-1]["authorization"] == f"Bearer {TOKEN}"
        assert TOKEN not in caplog.text

        # A whole instrumented cluster in another process, Python logging at DEBUG.
        collector.metadata.clear()
        code = textwrap.dedent(
            """
            import logging
            logging.basicConfig(level=logging.DEBUG)
            from distributed import Client, LocalCluster
            import dask_otel
            dask_otel.DaskInstrumentor().instrument()
            with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as c:
                with Client(c) as client:
                    print(client.submit(lambda: 40 + 2).result())
                    try:
                        client.submit(lambda: 1 / 0).result()
                    except ZeroDivisionError:
                        pass
            """
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
            OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer {TOKEN}",
            OTEL_PYTHON_LOG_LEVEL="debug",
            OTEL_LOG_LEVEL="debug",
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True,
            timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["42"]
        assert "DEBUG" in out.stderr  # the logs were verbose indeed
        assert TOKEN not in out.stdout + out.stderr
        assert collector.rx.spans("compute lambda")
        assert collector.metadata
        assert all(m.get("authorization") == f"Bearer {TOKEN}" for m in collector.metadata)
    finally:
        collector.close()


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 (openssl CLI; ``cryptography`` is absent)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_otlp_over_tls_with_the_standard_certificate_setting(certificate, monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    cert, key = certificate
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    collector = Collector(credentials)
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"https://127.0.0.1:{collector.port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer {TOKEN}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        provider = TracerProvider()
        span = provider.get_tracer("t").start_span("over-tls")
        span.end()
        # Without the certificate the collector's is not trusted: nothing is sent.
        untrusted = OTLPSpanExporter()
        assert untrusted.export([span]) == SpanExportResult.FAILURE
        untrusted.shutdown()
        assert not collector.rx.spans()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        trusted = OTLPSpanExporter()
        assert trusted.export([span]) == SpanExportResult.SUCCESS
        trusted.shutdown()
        assert [s["name"] for s in collector.rx.spans()] == ["over-tls"]
        assert collector.metadata[-1]["authorization"] == f"Bearer {TOKEN}"
    finally:
        collector.close()


# -- no listening port ----------------------------------------------------------------------


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process ``pid`` and its children listen on."""
    process = psutil.Process(pid)
    ports = set()
    for p in [process, *process.children(recursive=True)]:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                ports.add(c.laddr.port)
    return ports


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_dask_otel_opens_no_listening_port(receiver, processes):
    """A scheduler and a worker (with its Nanny) under opentelemetry-instrument listen on
    Dask's own ports and nothing else."""
    env = otel_env(receiver)
    address = start_scheduler(processes, env)
    ((scheduler, _),) = processes.procs
    worker = start_worker(processes, env, address, "worker")
    with Client(address, timeout=60) as client:
        client.wait_for_workers(1, timeout=90)
        assert client.submit(sum, [1, 2]).result(timeout=60) == 3
        (worker_address, info) = next(iter(client.scheduler_info()["workers"].items()))
        # Dask's own: the comm ports and the HTTP servers (also with --no-dashboard).
        dask_ports = {
            port(address),
            port(worker_address),
            port(info["nanny"]),
            client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port),
            *client.run(lambda dask_worker: dask_worker.http_server.port).values(),
        }
        # dask-otel is active in both: their spans arrived.
        receiver.wait_for(lambda r: r.spans("graph sum") and r.spans("task sum"))
        assert listening_ports(scheduler.pid) | listening_ports(worker.pid) == dask_ports
