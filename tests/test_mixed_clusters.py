"""Clusters where only some processes run dask-otel: Dask works as ever, and the spans
that can exist do exist.

Real ``dask scheduler``/``dask worker`` processes, each under ``opentelemetry-instrument``
or plain (dask-otel installed but not activated), export into a receiver on 127.0.0.1;
the client is ``tests/scripts/workload.py``.
"""

from __future__ import annotations

import json
import operator
import os
import re
import site
import subprocess
import sys
import time

import pytest
from conftest import HERE, bin_path, otel_env, start_scheduler, start_worker
from distributed import Client
from traces import by_trace, orphans

import dask_otel


def run_workload(processes, env, address: str, instrumented: bool) -> str:
    """Runs the workload client; checks its results; returns its stderr."""
    command = [sys.executable, str(HERE / "scripts" / "workload.py"), address]
    if instrumented:
        command = [bin_path("opentelemetry-instrument"), *command]
    out = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=180, cwd=processes.tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr + processes.logs()
    observed = json.loads(out.stdout.strip().splitlines()[-1])
    assert observed == {"results": list(range(1, 9)), "logged": 7, "failed": "injected failure 1"}
    return out.stderr


#: What a traced client says, once, of a scheduler without dask-otel (README).
NO_SCHEDULER_PLUGIN = "runs no dask-otel"


def assert_no_complaints(text: str, said: str | None = None) -> None:
    """Nothing dask-otel says when something is wrong, and no stray exception; but the
    one line ``said`` names, once, when given."""
    lines = text.splitlines()
    if said is not None:
        assert sum(said in line for line in lines) == 1, text
        lines = [line for line in lines if said not in line]
    rest = "\n".join(lines)
    assert "dask-otel:" not in rest, text
    assert "Traceback (most recent call last)" not in rest, text


def span_sources(rx) -> set[str]:
    return {s["resource"]["service.name"] for s in rx.spans()}


def test_instrumented_workers_with_a_plain_scheduler(receiver, processes):
    """No scheduler spans: the client's trace still gets every task attempt, each under
    the client's span (no scheduler to name generations: ids of their own)."""
    env = otel_env(receiver)
    address = start_scheduler(processes, env, instrumented=False)
    for name in ("w0", "w1"):
        start_worker(processes, env, address, name)
    stderr = run_workload(processes, env, address, instrumented=True)

    receiver.wait_for(lambda r: len(r.spans(name="task slow_inc")) == 8)
    executes = receiver.spans(name="task slow_inc")
    (compute,) = receiver.spans(name="compute slow_inc")
    # One trace: the client's span and the tasks under it.
    assert {s["trace_id"] for s in executes} == {compute["trace_id"]}
    assert {s["parent_span_id"] for s in executes} == {compute["span_id"]}
    assert not orphans([compute, *executes])
    assert len({s["resource"]["service.instance.id"] for s in executes}) == 2
    receiver.wait_for(lambda r: len(r.spans(name="attempt fail")) == 2)
    attempts = receiver.spans(name="attempt fail")
    assert all(s["status_code"] == 2 for s in attempts)
    assert len({s["span_id"] for s in attempts}) == 2
    (compute_fail,) = receiver.spans(name="compute fail")
    assert {s["parent_span_id"] for s in attempts} == {compute_fail["span_id"]}
    # Nothing from the scheduler: no graph, no span for the task that failed.
    assert not [s for s in receiver.spans() if s["name"].startswith("graph")]
    assert not receiver.spans(name="task fail")
    assert span_sources(receiver) == {"dask-client", "dask-worker"}
    # The workers still learn the cluster's id from the plain scheduler.
    points = receiver.wait_for(lambda r: r.metrics(name="dask.worker.memory"))
    assert {p["attributes"]["dask.cluster.id"][:10] for p in points} == {"Scheduler-"}
    assert_no_complaints(stderr + processes.logs(), said=NO_SCHEDULER_PLUGIN)


def test_a_plain_worker_among_instrumented_ones(receiver, processes):
    """Task spans from the instrumented worker only (the plain one emits none, and the
    scheduler none for tasks that went fine), every one in the graph's trace."""
    env = otel_env(receiver)
    address = start_scheduler(processes, env)
    start_worker(processes, env, address, "traced")
    start_worker(processes, env, address, "plain", instrumented=False)
    stderr = run_workload(processes, env, address, instrumented=False)

    def graph_done(r):
        graphs = [
            g
            for g in r.spans()
            if g["name"].startswith("graph") and g["attributes"]["dask.graph.tasks"] == 8
        ]
        return graphs and graphs[0]["attributes"]["dask.graph.memory"] == 8 and graphs[0]

    graph = receiver.wait_for(graph_done)

    def traced_worker(r):
        return {
            p["attributes"]["dask.worker.address"] for p in r.metrics(name="dask.worker.memory")
        }

    (traced,) = receiver.wait_for(traced_worker)
    # Every task span the traced worker made (none from the plain one: both ran tasks).
    tasks = receiver.wait_for(lambda r: r.spans(name="task slow_inc"))
    assert {t["attributes"]["dask.worker.address"] for t in tasks} == {traced}
    assert 0 < len(tasks) < 8
    assert {t["parent_span_id"] for t in tasks} == {graph["span_id"]}
    trace = by_trace(receiver.spans())[tasks[0]["trace_id"]]
    assert not orphans(trace)
    assert_no_complaints(stderr + processes.logs())


def test_an_instrumented_client_with_a_plain_cluster(receiver, processes):
    """Only the client traces: its spans, nothing else, and Dask does not mind the
    trace context riding in the tasks' annotations."""
    env = otel_env(receiver)
    address = start_scheduler(processes, env, instrumented=False)
    for name in ("w0", "w1"):
        start_worker(processes, env, address, name, instrumented=False)
    stderr = run_workload(processes, env, address, instrumented=True)

    names = {"compute slow_inc", "compute log_marker", "compute fail"}
    receiver.wait_for(lambda r: names <= {s["name"] for s in r.spans()})
    assert span_sources(receiver) == {"dask-client"}
    assert {s["name"] for s in receiver.spans()} == names
    assert len(by_trace(receiver.spans(name="compute slow_inc"))) == 1
    assert_no_complaints(stderr + processes.logs(), said=NO_SCHEDULER_PLUGIN)


def site_packages_without_dask_otel(root) -> list[str]:
    """Each site-packages directory as a shadow of symlinks under ``root``: every entry
    but dask-otel's own (package, metadata, editable-install hooks), so that a regular
    ``pip install .`` is as absent there as an editable one."""
    shadows = []
    for index, directory in enumerate(site.getsitepackages()):
        shadow = root / f"site-packages-{index}"
        shadow.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(directory):
            if not OWN_ENTRY.match(entry.name) and not (shadow / entry.name).exists():
                (shadow / entry.name).symlink_to(entry.path)
        shadows.append(str(shadow))
    return shadows


#: The names of dask-otel's entries in site-packages, however it was installed.
OWN_ENTRY = re.compile(r"(__editable__[._])?dask_otel([-._].*)?$", re.IGNORECASE)


def start_worker_without_dask_otel(processes, env, address: str, name: str):
    """A one-thread ``dask worker`` (with a Nanny) in which ``import dask_otel`` fails,
    as on a host where it is not installed (``tests/scripts/without_dask_otel.py``)."""
    shadows = site_packages_without_dask_otel(processes.tmp_path / "without-dask-otel")
    env = {**env, "SITE_PACKAGES": os.pathsep.join(shadows)}
    command = [sys.executable, "-S", str(HERE / "scripts" / "without_dask_otel.py"), address]
    command += ["--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard", "--name", name]
    return processes.start(command, env, name)


#: What the client says, once for each process, of one where dask-otel is not installed.
NOT_INSTALLED = "runs without dask-otel (not installed there)"


@pytest.mark.timeout(240)
def test_workers_where_dask_otel_is_not_installed(receiver, processes, telemetry, capsys):
    """``instrument(client)`` with a worker that cannot import dask-otel, and one such
    worker that joins later: both start and compute as plain, and the client says once
    for each of these processes that it runs untraced."""

    def _dask_otel_importable() -> bool:  # local: pickled by value
        import importlib.util

        return importlib.util.find_spec("dask_otel") is not None

    env = otel_env(receiver)
    address = start_scheduler(processes, env)
    start_worker_without_dask_otel(processes, env, address, "before")
    with Client(address, timeout=60) as client:
        client.wait_for_workers(1, timeout=60)
        (importable,) = client.run(_dask_otel_importable).values()
        assert importable is False  # the arrangement holds in the worker process
        dask_otel.instrument(client)
        start_worker_without_dask_otel(processes, env, address, "after")
        client.wait_for_workers(2, timeout=60)
        workers = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        for name in ("before", "after"):
            futures = client.map(operator.add, range(4), [1] * 4, workers=[workers[name]])
            assert client.gather(futures) == [1, 2, 3, 4]
        assert set(client.run(_dask_otel_importable).values()) == {False}

        said = []  # the events of the Nanny and the worker that joined later come late
        deadline = time.monotonic() + 30
        while len(said) < 4 and time.monotonic() < deadline:
            said += [line for line in capsys.readouterr().err.splitlines() if NOT_INSTALLED in line]
            time.sleep(0.2)
        time.sleep(1)  # and nothing more after the four
        said += [line for line in capsys.readouterr().err.splitlines() if NOT_INSTALLED in line]
    # "dask-otel: the worker ADDRESS runs without ...": each process of the two, once.
    told = sorted((line.split()[2], line.split()[3]) for line in said)
    assert [role for role, _ in told] == ["nanny", "nanny", "worker", "worker"], said
    assert {address for role, address in told if role == "worker"} == set(workers.values())
    assert len({address for _, address in told}) == 4, said
    logs = processes.logs()
    assert "nanny-start-failed" not in logs, logs
    assert "Traceback (most recent call last)" not in logs, logs
    assert not receiver.spans(name="task add")
