"""Dask's own mechanism: `--preload dask_otel` and the `distributed.*.preload` config.

No `opentelemetry-instrument` anywhere and a plain client: the scheduler roots the trace.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import HERE, PRELOAD, otel_env, start_scheduler, start_worker
from traces import check_workload_telemetry


def test_preload_scheduler_and_workers(receiver, processes):
    env = otel_env(receiver)
    address = start_scheduler(processes, env, instrumented=False, options=PRELOAD)
    # One worker preloads in the worker process, the other in its Nanny.
    start_worker(processes, env, address, "worker0", instrumented=False, options=PRELOAD)
    nanny_preload = ("--preload-nanny", "dask_otel")
    start_worker(processes, env, address, "worker1", instrumented=False, options=nanny_preload)
    check_scheduler_rooted(receiver, run_workload(address, env, processes.tmp_path))
    # The Nanny that preloads dask_otel exports its own records, named as a Nanny.
    nanny = receiver.wait_for(
        lambda r: [x for x in r.log_records() if x["resource"]["service.name"] == "dask-nanny"]
    )
    (started,) = [x for x in nanny if "Start Nanny at" in str(x["body"])]
    assert started["attributes"]["dask.nanny.address"] in str(started["body"])


def test_preload_config(receiver, tmp_path):
    """`distributed.{scheduler,worker}.preload` config, inherited by Nanny workers."""
    env = otel_env(
        receiver,
        DASK_DISTRIBUTED__SCHEDULER__PRELOAD='["dask_otel"]',
        DASK_DISTRIBUTED__WORKER__PRELOAD='["dask_otel"]',
    )
    check_scheduler_rooted(receiver, run_workload("local", env, tmp_path))


def run_workload(address, env, cwd):
    out = subprocess.run(
        [sys.executable, str(HERE / "scripts" / "workload.py"), address],
        env=env, capture_output=True, text=True, timeout=180, cwd=cwd,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_scheduler_rooted(receiver, observed):
    check_workload_telemetry(
        receiver, observed, roles={"dask-scheduler", "dask-worker"}, client_traced=False
    )
    assert not receiver.spans(name="compute slow_inc")
    (graph,) = receiver.spans(name="graph slow_inc")
    assert graph["attributes"]["dask.graph.tasks"] == 8
    assert graph["parent_span_id"] is None
