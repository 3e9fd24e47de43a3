"""Instrumenting and not: a client dask-otel never instrumented, ``instrument(client)``
(asynchronous clients too), ``uninstrument``, and ``otel.enabled: false``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import dask
import pytest
from conftest import flush_emitters, in_process_cluster
from distributed import Client, LocalCluster
from opentelemetry.trace import SpanKind
from span_checks import (
    assert_no_orphans,
    assert_task_ids_line_up,
    by_trace,
    cluster_and_client,
    inc,
    only,
    scheduler_plugins,
    worker_plugins,
)

import dask_otel

# -- client not instrumented ------------------------------------------------------------


def test_uninstrumented_client_gets_a_root_graph_span(telemetry):
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
    ) as cluster:
        dask_otel.DaskInstrumentor().uninstrument()
        with Client(cluster) as client:
            assert "dask-otel" in scheduler_plugins(client)
            assert all("dask-otel" in p for p in worker_plugins(client).values())
            futures = client.map(inc, range(3))
            assert client.submit(sum, futures).result() == 6
            flush_emitters(client)
            cluster_id = client.scheduler_info()["id"]

    spans = telemetry.spans()
    assert not telemetry.spans("compute")
    traces = by_trace(spans)
    assert len(traces) == 2
    # Named after what ran, as the client's `compute` span would be.
    roots = sorted(s.name for s in spans if s.name.startswith("graph"))
    assert roots == ["graph inc", "graph sum"]
    for trace_spans in traces.values():
        (graph,) = [s for s in trace_spans if s.name in roots]
        assert graph.parent is None
        assert graph.kind == SpanKind.INTERNAL
        for span in trace_spans:
            if span.name.startswith("task "):
                assert span.parent.span_id == graph.context.span_id
    assert len(telemetry.spans("task ")) == 4
    assert_task_ids_line_up(spans)
    assert_no_orphans(spans)
    assert all(s.attributes["dask.cluster.id"] == cluster_id for s in spans)


# -- uninstrument -----------------------------------------------------------------------


def test_no_plugins_after_uninstrument(telemetry):
    with cluster_and_client() as (_, client):
        assert "dask-otel" in scheduler_plugins(client)
        assert all("dask-otel" in p for p in worker_plugins(client).values())

    dask_otel.DaskInstrumentor().uninstrument()

    with cluster_and_client() as (_, client):
        assert "dask-otel" not in scheduler_plugins(client)
        plugins = worker_plugins(client)
        assert len(plugins) == 2
        assert all("dask-otel" not in p for p in plugins.values())
        assert client.submit(inc, 1).result() == 2
        assert not any(client.run(lambda dask_worker: "execute" in vars(dask_worker)).values())
    assert not telemetry.spans()


# -- disabled by config -----------------------------------------------------------------


def test_disabled_by_config(telemetry):
    with dask.config.set({"otel.enabled": False}), cluster_and_client() as (_, client):
        futures = client.map(inc, range(3))
        assert client.submit(sum, futures).result() == 6
        flush_emitters(client)
        patched = client.run(lambda dask_worker: "execute" in vars(dask_worker))
    assert telemetry.spans() == []
    assert not any(patched.values())


class Records(logging.Handler):
    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def recorded(name: str, level: int = logging.INFO) -> Iterator[Records]:
    """The messages of logger ``name`` from ``level`` up, in this block."""
    records = Records(level)
    logger = logging.getLogger(name)
    logger.addHandler(records)
    saved = logger.level
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(saved)


def test_disabled_plugin_from_a_preload_stays_quiet(telemetry):
    """Off, the scheduler plugin a preload attached does nothing: its hooks raise nothing
    (Dask would log "Plugin failed with exception" at each of every task's transitions)."""
    with (
        recorded("distributed.scheduler") as records,
        dask.config.set({"otel.enabled": False}),
        in_process_cluster(n_workers=1, scheduler_kwargs={"preload": ["dask_otel"]}) as client,
    ):
        assert "dask-otel" in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.plugins)
        )
        assert client.submit(inc, 1).result() == 2
    assert not [m for m in records.messages if "Plugin failed" in m]
    assert telemetry.spans() == []


def test_disabled_client_with_an_enabled_cluster(telemetry):
    """`enabled` is read by each component: a disabled client sends no context."""
    with cluster_and_client() as (_, client):
        with dask.config.set({"otel.enabled": False}):
            assert client.submit(inc, 1).result() == 2
        flush_emitters(client)
    assert not telemetry.spans("compute")
    assert only(telemetry.spans(), "graph inc").parent is None
    assert_task_ids_line_up(telemetry.spans())


# -- instrument(client) -----------------------------------------------------------------


def test_instrument_and_uninstrument_an_asynchronous_client(telemetry):
    """With ``Client(asynchronous=True)`` both return awaitables, as the client's methods
    do; before, they registered nothing and said nothing."""
    dask_otel.DaskInstrumentor().uninstrument()  # a cluster without dask-otel to start

    def plugins(dask_scheduler=None, dask_worker=None):
        return "dask-otel" in (dask_scheduler or dask_worker).plugins

    async def main() -> list[bool]:
        async with (
            LocalCluster(
                n_workers=1, processes=False, asynchronous=True, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            seen = [await client.run_on_scheduler(plugins)]
            await dask_otel.instrument(client, tracer_provider=telemetry.tracer_provider)
            seen += [await client.run_on_scheduler(plugins), *(await client.run(plugins)).values()]
            await dask_otel.uninstrument(client)
            seen += [await client.run_on_scheduler(plugins), *(await client.run(plugins)).values()]
            return seen

    assert asyncio.run(main()) == [False, True, True, False, False]


def test_instrument_an_asynchronous_client_with_dask_otel_off(telemetry):
    """Off (``otel.enabled: false``), ``await dask_otel.instrument(client)`` still works."""

    async def main() -> bool:
        async with (
            LocalCluster(
                n_workers=1, processes=False, asynchronous=True, dashboard_address="127.0.0.1:0"
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            await dask_otel.instrument(client)
            await dask_otel.uninstrument(client)
            return True

    with dask.config.set({"otel.enabled": False}):
        assert asyncio.run(main())


def test_instrument_client_twice_then_uninstrument(telemetry):
    # Start from a cluster without dask-otel: the fixture's instrumentation would add it.
    dask_otel.DaskInstrumentor().uninstrument()
    with cluster_and_client() as (_, client):
        assert "dask-otel" not in scheduler_plugins(client)

        def plugin_ids(dask_scheduler=None, dask_worker=None):
            server = dask_scheduler or dask_worker
            plugin = server.plugins.get("dask-otel")
            return id(plugin) if plugin is not None else None

        providers = {
            "tracer_provider": telemetry.tracer_provider,
            "meter_provider": telemetry.meter_provider,
            "logger_provider": telemetry.logger_provider,
        }
        dask_otel.instrument(client, **providers)
        first = (client.run_on_scheduler(plugin_ids), client.run(plugin_ids))
        dask_otel.instrument(client, **providers)
        second = (client.run_on_scheduler(plugin_ids), client.run(plugin_ids))
        assert first[0] is not None
        assert all(v is not None for v in first[1].values())
        assert second == first  # registered once: the second call replaced nothing

        def wrapped_once(dask_worker):
            execute = vars(dask_worker).get("execute")
            tracer = getattr(execute, "__self__", None)
            return tracer is not None and getattr(tracer.original, "__self__", None) is dask_worker

        assert all(client.run(wrapped_once).values())

        assert client.submit(inc, 1).result() == 2
        flush_emitters(client)
        names = sorted(s.name for s in telemetry.spans())
        assert names == ["compute inc", "graph", "task inc"]

        dask_otel.uninstrument(client)
        assert "dask-otel" not in scheduler_plugins(client)
        assert all("dask-otel" not in p for p in worker_plugins(client).values())
        assert not any(client.run(lambda dask_worker: "execute" in vars(dask_worker)).values())

        assert client.submit(inc, 2).result() == 3
        assert len(telemetry.spans()) == 3  # nothing new


@pytest.mark.parametrize(
    "off", ["otel.enabled: false", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=dask"]
)
def test_uninstrument_with_dask_otel_off_is_a_quiet_no_op(telemetry, monkeypatch, off):
    """Off, ``instrument(client)`` registered nothing: ``uninstrument(client)`` asks the
    scheduler to remove nothing (Dask logs an ERROR with a traceback for each plugin it
    does not have)."""
    dask_otel.DaskInstrumentor().uninstrument()  # a cluster without dask-otel to start
    if off.startswith("OTEL_"):
        monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "dask")
    with (
        recorded("distributed", logging.ERROR) as records,
        dask.config.set({"otel.enabled": off.startswith("OTEL_")}),
        in_process_cluster(n_workers=1) as client,
    ):
        dask_otel.instrument(client)
        assert "dask-otel" not in scheduler_plugins(client)
        dask_otel.uninstrument(client)
        assert client.submit(inc, 1).result() == 2
    assert records.messages == []


def test_dask_otels_own_runs_leave_no_line_in_the_clusters_logs(telemetry):
    """``instrument`` and ``uninstrument`` run functions on the scheduler and workers;
    Dask's "Run out-of-band function" line stays for the user's own runs only."""
    dask_otel.DaskInstrumentor().uninstrument()  # a cluster without dask-otel to start
    with recorded("distributed.worker") as records, in_process_cluster(n_workers=1) as client:
        dask_otel.instrument(client, tracer_provider=telemetry.tracer_provider)
        assert "dask-otel" in scheduler_plugins(client)
        client.run(inc, 1)
        dask_otel.uninstrument(client)
    runs = [m for m in records.messages if m.startswith("Run out-of-band")]
    # The test's own: scheduler_plugins runs a lambda.
    assert runs == ["Run out-of-band function 'lambda'", "Run out-of-band function 'inc'"], runs
