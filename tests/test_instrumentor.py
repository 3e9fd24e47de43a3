"""The OpenTelemetry side of the package: entry points, the instruments extra, kill switch."""

from __future__ import annotations

from importlib.metadata import distribution, entry_points

import pytest
from conftest import flush_emitters, in_process_cluster

import dask_otel


def test_entry_points_are_registered():
    (instrumentor,) = entry_points(group="opentelemetry_instrumentor", name="dask")
    assert instrumentor.load() is dask_otel.DaskInstrumentor
    (configurator,) = entry_points(group="opentelemetry_configurator", name="dask_otel")
    assert configurator.load().__name__ == "DaskOtelConfigurator"


def test_instruments_extra_names_the_supported_distributed_range():
    requires = distribution("dask-otel").requires or []
    extra = [r for r in requires if 'extra == "instruments"' in r]
    assert extra and all(r.startswith("distributed>=2025.9.0") for r in extra)
    dependencies = dask_otel.DaskInstrumentor().instrumentation_dependencies()
    assert dependencies == ("distributed >= 2025.9.0",)


def test_dashed_commands_are_declared():
    # Older distributed releases ship their own dask-worker/dask-scheduler scripts (the
    # same commands); whichever pip installed last is on PATH: both must be ours to run.
    scripts = {
        ep.name: ep.value
        for ep in distribution("dask-otel").entry_points
        if ep.group == "console_scripts"
    }
    assert scripts == {
        "dask-otel": "dask_otel.tools.cli:main",
        "dask-worker": "dask_otel.tools.cli:dask_worker",
        "dask-scheduler": "dask_otel.tools.cli:dask_scheduler",
    }


@pytest.mark.parametrize("names", ["dask", "requests, dask ,flask"])
def test_disabled_instrumentations_switch_dask_otel_off(telemetry, monkeypatch, names):
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", names)
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(sum, [1, 2]).result() == 3
        flush_emitters(client)
    assert telemetry.spans() == []


def test_other_disabled_instrumentations_leave_dask_otel_on(telemetry, monkeypatch):
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "requests,daskish")
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(sum, [1, 2]).result() == 3
        flush_emitters(client)
    assert {s.name for s in telemetry.spans()} == {
        "compute sum",
        "graph",
        "task sum",
    }
