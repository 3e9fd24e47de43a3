"""A traced client whose submissions get no ``graph`` span back (the cluster exports
nowhere, or runs no dask-otel) says so once on stderr; the summary counts them as a gap."""

from __future__ import annotations

import pytest
from conftest import QUICK_EXPORTS, run_client, start_scheduler, start_worker
from otlp_receiver import closed_port, exporting_env


@pytest.mark.parametrize("cluster", ["exporting nowhere", "without dask-otel"])
def test_a_client_says_once_that_the_cluster_does_not_answer(processes, receiver, cluster):
    dead = f"127.0.0.1:{closed_port()}"
    instrumented = cluster == "exporting nowhere"
    env = exporting_env(f"http://{dead}", **QUICK_EXPORTS)
    address = start_scheduler(processes, env, instrumented=instrumented)
    start_worker(processes, env, address, "w0", instrumented=instrumented)
    client_env = exporting_env(receiver.grpc_endpoint, **QUICK_EXPORTS)
    said, _ = run_client(processes, client_env, address, "60", script="unanswered_client.py")
    assert len(said) == 1, said
    (line,) = said
    assert line.endswith("This client's submissions get no graph span back."), line
    if instrumented:
        assert f"the scheduler at {address} cannot export to {dead}" in line, line
    else:
        assert f"the scheduler at {address} runs no dask-otel" in line, line
    receiver.wait_for(lambda rx: len(rx.spans("compute inc")) == 2)
    assert not receiver.spans("graph")
