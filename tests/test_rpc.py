"""``rpc <op>`` spans: recorded under a traced operation or for the ops always recorded."""

from __future__ import annotations

import threading

import dask
import pytest
from conftest import flush_emitters, in_process_cluster
from distributed import core, scheduler, worker
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

import dask_otel
from dask_otel.plugins import rpc


def inc(x: int) -> int:
    return x + 1


def rpc_spans(telemetry) -> list:
    return telemetry.spans("rpc ")


def test_every_binding_of_send_recv_is_patched_and_restored(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(inc, 1).result() == 2
        for module in (core, worker, scheduler):
            assert module.send_recv is rpc.send_recv
    dask_otel.DaskInstrumentor().uninstrument()
    for module in (core, worker, scheduler):
        assert module.send_recv is core.send_recv
    assert (core.send_recv.__module__, core.send_recv.__name__) == ("distributed.core", "send_recv")


def test_requests_under_a_user_span_nest_beneath_it(telemetry):
    tracer = telemetry.tracer_provider.get_tracer("user")
    with in_process_cluster(n_workers=1) as client:
        future = client.submit(inc, 1)
        assert future.result() == 2
        with tracer.start_as_current_span("user work") as user:
            who_has = client.who_has([future])
        assert list(who_has) == [future.key]
        flush_emitters(client)

    (span,) = [s for s in rpc_spans(telemetry) if s.name == "rpc who_has"]
    assert span.kind == SpanKind.CLIENT
    assert span.parent.span_id == user.get_span_context().span_id
    assert span.attributes["rpc.system.name"] == "dask"
    assert span.attributes["rpc.method"] == "who_has"
    assert span.attributes["server.address"] == span.attributes["network.peer.address"]
    assert span.attributes["dask.cluster.id"].startswith("Scheduler-")
    # Nothing else was traced: heartbeats, identity, the client's own chatter.
    assert [s.name for s in rpc_spans(telemetry)] == ["rpc who_has"]


def test_failed_request_is_an_error_span(telemetry):
    tracer = telemetry.tracer_provider.get_tracer("user")
    with in_process_cluster(n_workers=1) as client:
        with tracer.start_as_current_span("user work"), pytest.raises(TypeError):
            # The scheduler's handler raises: Dask re-raises it in the caller.
            client.sync(client.scheduler.ncores, workers=5)
        assert client.submit(inc, 1).result() == 2

    (span,) = rpc_spans(telemetry)
    assert span.name == "rpc ncores"
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "TypeError"


def test_always_recorded_ops_get_client_and_server_spans(telemetry):
    config = {"otel.rpc.always-record": ["who_has", "identity"]}
    with dask.config.set(config), in_process_cluster(n_workers=1) as client:
        future = client.submit(inc, 1)
        assert future.result() == 2
        assert list(client.who_has([future])) == [future.key]
        flush_emitters(client)

    spans = [s for s in rpc_spans(telemetry) if s.name == "rpc who_has"]
    assert sorted(s.kind.name for s in spans) == ["CLIENT", "SERVER"]
    assert all(s.parent is None for s in spans)  # nothing traced was current
    # never-record wins over always-record: identity is background chatter.
    assert not [s for s in rpc_spans(telemetry) if s.name == "rpc identity"]


async def _teardown_leaves_dask_s_handler(dask_worker) -> bool:
    await dask_worker.plugins[dask_otel.PLUGIN_NAME].teardown(dask_worker)
    return dask_worker.handlers["get_data"] == dask_worker.get_data


def test_worker_teardown_restores_an_always_recorded_patched_handler(telemetry):
    """``get_data`` is patched (``get_data`` spans) and wrapped (``rpc get_data`` spans):
    teardown must undo both, or a later setup would trace it twice."""
    config = {"otel.rpc.always-record": ["get_data"]}
    with dask.config.set(config), in_process_cluster(n_workers=1) as client:
        assert client.submit(inc, 1).result() == 2
        assert list(client.run(_teardown_leaves_dask_s_handler).values()) == [True]


def test_rpc_spans_switched_off(telemetry):
    tracer = telemetry.tracer_provider.get_tracer("user")
    config = {"otel.spans.rpc": False, "otel.rpc.always-record": ["who_has"]}
    with dask.config.set(config), in_process_cluster(n_workers=2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, workers=[a])
        y = client.submit(inc, x, workers=[b])
        with tracer.start_as_current_span("user work"):
            assert y.result() == 3
            client.who_has([y])
        flush_emitters(client)
    assert telemetry.spans("transfer")
    assert not rpc_spans(telemetry)


class BuiltBy(SpanProcessor):
    """Notes the thread each ``rpc`` span is built (ended) in."""

    def __init__(self) -> None:
        self.threads: dict[str, set[str]] = {}

    def on_end(self, span) -> None:
        if span.name.startswith("rpc "):
            self.threads.setdefault(span.name, set()).add(threading.current_thread().name)


def test_rpc_spans_are_built_off_the_event_loop_after_the_request(telemetry):
    built_by = BuiltBy()
    telemetry.tracer_provider.add_span_processor(built_by)
    tracer = telemetry.tracer_provider.get_tracer("user")
    config = {"otel.rpc.always-record": ["who_has"]}
    with dask.config.set(config), in_process_cluster(n_workers=2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, workers=[a])
        y = client.submit(inc, x, workers=[b])  # its input travels: rpc get_data
        assert y.result() == 3
        with tracer.start_as_current_span("user work") as user:
            client.who_has([y])
        flush_emitters(client)

    assert built_by.threads == {
        name: {"dask-otel-spans"} for name in ("rpc get_data", "rpc who_has")
    }
    client_span, server_span = sorted(
        (s for s in rpc_spans(telemetry) if s.name == "rpc who_has"), key=lambda s: s.kind.name
    )
    assert client_span.parent.span_id == user.get_span_context().span_id
    assert server_span.kind == SpanKind.SERVER and server_span.parent is None
    # Timed by the request itself, not by when the span was built.
    assert user.start_time <= client_span.start_time <= client_span.end_time <= user.end_time
    assert client_span.start_time <= server_span.start_time <= server_span.end_time
    assert server_span.end_time <= client_span.end_time
