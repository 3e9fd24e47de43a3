"""Telemetry problems never change what Dask computes, nor leak state, nor hang a close."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import flush_emitters, in_process_cluster
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import dask_otel
from dask_otel import runtime as dask_telemetry


def inc(x: int) -> int:
    return x + 1


def plugin_state(dask_scheduler) -> tuple[int, int]:
    held = dask_scheduler.plugins["dask-otel"].held()
    return held["records"], held["graphs"]


def test_scattered_data_is_not_recorded_and_graphs_end(telemetry):
    with in_process_cluster(n_workers=1) as client:
        x = client.scatter(41)
        assert client.submit(inc, x).result() == 42
        flush_emitters(client)
        # Nothing waits on the scattered key: no record left, the graph span ended.
        assert client.run_on_scheduler(plugin_state) == (0, 0)
        (graph,) = telemetry.spans("graph")
        assert graph.attributes["dask.graph.tasks"] == 1
    assert [s.name for s in telemetry.spans("task")] == ["task inc"]


class FailingProcessor(SpanProcessor):
    """A broken SpanProcessor, as a user might register."""

    def on_start(self, span, parent_context=None) -> None:
        raise RuntimeError("broken processor")


def test_failing_span_processor_changes_no_result():
    provider = TracerProvider()
    provider.add_span_processor(FailingProcessor())
    dask_otel.DaskInstrumentor().instrument(tracer_provider=provider)
    try:
        with in_process_cluster() as client:
            assert client.submit(sum, client.map(inc, range(10))).result() == 55
            with pytest.raises(ZeroDivisionError):
                client.submit(lambda: 1 / 0).result()
    finally:
        dask_otel.DaskInstrumentor().uninstrument()
        provider.shutdown()


def test_bad_sdk_settings_do_not_fail_submissions(tmp_path):
    code = textwrap.dedent(
        """
        from distributed import Client, LocalCluster
        import dask_otel
        dask_otel.DaskInstrumentor().instrument()
        with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as c:
            with Client(c) as client:
                print(client.submit(lambda: 40 + 2).result())
                print(client.submit(lambda: 1 + 1).result())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env["OTEL_TRACES_EXPORTER"] = "no-such-exporter"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["42", "2"]
    # Said once (for the scheduler, worker and client of this process), naming the problem.
    assert out.stderr.count("dask-otel: cannot configure OpenTelemetry") == 1
    assert "no-such-exporter" in out.stderr


def test_flush_is_bounded_when_the_collector_stalls():
    """A collector that accepts connections and never answers: flush gives up in time."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        port = stalled.getsockname()[1]
        provider = TracerProvider()
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True))
        )
        provider.get_tracer("t").start_span("s").end()
        current = dask_telemetry.current()
        providers = dask_telemetry.Providers(
            provider, current.meter_provider, current.logger_provider
        )
        started = time.monotonic()
        assert dask_telemetry.flush(providers, 1.0) is False
        assert time.monotonic() - started < 2.0
