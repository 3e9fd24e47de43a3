"""Zero-code: `opentelemetry-instrument dask-scheduler / dask-worker / python client.py`.

Real processes export over OTLP into a receiver on 127.0.0.1; nothing but dask-otel is
installed on top of the SDK.
"""

from __future__ import annotations

import pytest
from conftest import bin_path, otel_env, run_client, start_cluster
from traces import check_workload_telemetry, services


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_zero_code_cluster(receiver, processes, method):
    env = otel_env(receiver, DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=method)
    address = start_cluster(
        processes, env, [[bin_path("dask-worker")], [bin_path("dask"), "worker"]]
    )
    observed, _ = run_client(processes, env, address)
    check_workload_telemetry(receiver, observed)
    spans = receiver.spans()
    # Nanny children are named as workers, each with its own instance id, from their
    # first log line on (a forkserver's child sets up before its first line).
    assert len({i for n, i in services(spans) if n == "dask-worker"}) == 2
    started = receiver.wait_for(
        lambda r: [x for x in r.log_records() if "Start worker at" in str(x["body"])]
    )
    assert len(started) == 2
    assert {x["resource"]["service.name"] for x in started} == {"dask-worker"}
    # Dask's stderr output is untouched by the log bridge.
    assert "distributed.worker - ERROR - Compute Failed" in processes.logs()

    # Stopping a worker: the scheduler's remove-worker event arrives as a log record.
    worker_proc = processes.procs[-1][0]
    assert processes.stop(worker_proc) == 0
    removed = receiver.wait_for(
        lambda r: [x for x in r.log_records() if x["event_name"] == "dask.remove-worker"]
    )
    assert removed[0]["resource"]["service.name"] == "dask-scheduler"
    assert removed[0]["attributes"]["dask.worker.address"].startswith("tcp://127.0.0.1:")


def test_zero_code_over_http(receiver, processes):
    env = otel_env(receiver, protocol="http")
    address = start_cluster(processes, env, [[bin_path("dask-worker"), "--no-nanny"]] * 2)
    observed, _ = run_client(processes, env, address)
    check_workload_telemetry(receiver, observed)
    assert {transport for transport, _ in receiver.requests} == {"http"}
