"""Tasks that submit tasks (``worker_client``, ``get_client``) join their parent's trace,
in each of the three ways in: the subtasks' ``compute`` spans are children of the task
that submitted them, so ``fib(N)`` is one trace."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import (
    HERE,
    PRELOAD,
    bin_path,
    in_process_cluster,
    otel_env,
    start_cluster,
    start_scheduler,
    start_worker,
)
from distributed import Client
from traces import by_trace, orphans

import dask_otel

N = 6
TASKS = 25  # calls of fib for fib(6)


def run_fib(env, cwd, where, *options):
    out = subprocess.run(
        [sys.executable, str(HERE / "scripts" / "subtasks.py"), where, *options, str(N)],
        env=env, capture_output=True, text=True, timeout=240, cwd=cwd,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split()[-1] == "8"


def check_one_trace(receiver):
    def every_task(r):
        spans = [s for s in r.spans() if s["attributes"].get("dask.task.prefix") == "fib"]
        keys = {s["attributes"]["dask.task.key"] for s in spans}
        return len(keys) == TASKS and spans

    fib = receiver.wait_for(every_task, timeout=90)
    (trace_id,) = {s["trace_id"] for s in fib}

    def whole(r):  # each process exports on its own schedule
        spans = by_trace(r.spans())[trace_id]
        return not orphans(spans) and spans

    spans = receiver.wait_for(whole, timeout=60)
    # The subtasks' submissions, each under the task that made it.
    computes = [s for s in spans if s["name"].startswith("compute fib")]
    assert len(computes) >= TASKS // 2


@pytest.mark.parametrize("where", ["processes", "threads"])
def test_instrument_client(receiver, tmp_path, where):
    run_fib(otel_env(receiver), tmp_path, where, "--instrument")
    check_one_trace(receiver)


def test_opentelemetry_instrument(receiver, processes):
    env = otel_env(receiver)
    address = start_cluster(processes, env, [[bin_path("dask-worker")]] * 2)
    run_fib(env, processes.tmp_path, address)
    check_one_trace(receiver)


def test_preload(receiver, processes):
    env = otel_env(receiver)
    address = start_scheduler(processes, env, instrumented=False, options=PRELOAD)
    for i in range(2):
        start_worker(processes, env, address, f"worker{i}", instrumented=False, options=PRELOAD)
    run_fib(env, processes.tmp_path, address)
    check_one_trace(receiver)


def traced() -> bool:
    return hasattr(Client.__dict__["_graph_to_futures"], "__wrapped__")


def test_each_holder_keeps_clients_traced_until_it_lets_go(telemetry):
    """The instrumentor and every worker plugin hold the patch on the client: the last
    one to let go takes it off."""
    assert traced()
    with in_process_cluster(n_workers=2):
        dask_otel.DaskInstrumentor().uninstrument()
        assert traced()  # the workers' tasks may still submit subtasks
    assert not traced()
