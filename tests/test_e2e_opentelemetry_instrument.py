"""Zero-code: `opentelemetry-instrument dask-scheduler / dask-worker / python client.py`.

Real processes export over OTLP into a receiver on 127.0.0.1; nothing but dask-otel is
installed on top of the SDK.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HERE, bin_path, otel_env, wait_for_file
from traces import orphans, services, trace_of

OTEL = bin_path("opentelemetry-instrument")


def start_cluster(processes, env, worker_commands):
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
    return json.loads(scheduler_file.read_text())["address"]


def run_client(processes, env, address, *args):
    out = subprocess.run(
        [OTEL, sys.executable, str(HERE / "scripts" / "workload.py"), address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=processes.tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr + processes.logs()
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def check_workload_telemetry(rx, observed, worker_count=2):
    """The contract every activation path must meet for tests/scripts/workload.py."""
    assert observed["results"] == list(range(1, 9))
    assert observed["failed"] == "injected failure 1"

    # One trace for the map: client, scheduler and both workers, no missing parent.
    spans = rx.wait_for(
        lambda r: (
            len(r.spans(name="execute slow_inc")) >= 8
            and r.spans(name="task fail")
            and len(r.spans(name="task slow_inc")) >= 8
            and r.spans(name="graph")
            and r.spans()
        ),
    )
    spans = rx.spans()
    mapped = trace_of(spans, "compute slow_inc")
    names = sorted({s["name"] for s in mapped})
    assert names == ["compute slow_inc", "execute slow_inc", "graph", "task slow_inc"], names
    assert not orphans(mapped)
    roles = services(mapped)
    assert {name for name, _ in roles} == {"dask-client", "dask-scheduler", "dask-worker"}
    workers = {
        s["resource"]["service.instance.id"] for s in mapped if s["name"].startswith("execute")
    }
    assert len(workers) == worker_count
    cluster_ids = {s["attributes"].get("dask.cluster.id") for s in mapped}
    assert len(cluster_ids) == 1 and next(iter(cluster_ids)).startswith("Scheduler-")
    for task in (s for s in mapped if s["name"] == "task slow_inc"):
        assert [e["name"] for e in task["events"]][-2:] == ["processing", "memory"]
        assert task["attributes"]["dask.task.state"] == "memory"

    # retries=1: two failed attempts on workers, one ERROR task span on the scheduler.
    failed = trace_of(spans, "task fail")
    executes = [s for s in failed if s["name"] == "execute fail"]
    assert len(executes) == 2 and all(s["status_code"] == 2 for s in executes)
    (task,) = [s for s in failed if s["name"] == "task fail"]
    assert task["status_code"] == 2 and task["attributes"]["dask.task.attempts"] == 2
    (exc,) = [e for e in task["events"] if e["name"] == "exception"]
    assert exc["attributes"]["exception.type"] == "ValueError"
    assert not orphans(failed)

    # A log record written inside a task carries that task's execute span.
    records = rx.wait_for(
        lambda r: [x for x in r.log_records() if "marker-from-task 7" in str(x["body"])]
    )
    (execute,) = rx.spans(name="execute log_marker")
    assert records[0]["span_id"] == execute["span_id"]
    assert records[0]["trace_id"] == execute["trace_id"]


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_zero_code_cluster(receiver, processes, method):
    env = otel_env(receiver, DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=method)
    address = start_cluster(
        processes, env, [[bin_path("dask-worker")], [bin_path("dask"), "worker"]]
    )
    observed, _ = run_client(processes, env, address)
    check_workload_telemetry(receiver, observed)
    spans = receiver.spans()
    # Nanny children are named as workers, each with its own instance id.
    assert len({i for n, i in services(spans) if n == "dask-worker"}) == 2


def test_zero_code_over_http(receiver, processes):
    env = otel_env(receiver, protocol="http")
    address = start_cluster(processes, env, [[bin_path("dask-worker"), "--no-nanny"]] * 2)
    observed, _ = run_client(processes, env, address)
    check_workload_telemetry(receiver, observed)
    assert {transport for transport, _ in receiver.requests} == {"http"}
