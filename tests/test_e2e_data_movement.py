"""Data movement across real worker processes: transfers, RPCs and spilling in traces.

A ``dask-scheduler`` and two ``dask-worker`` processes under ``opentelemetry-instrument``
whose spill target is 20 MB; the client (tests/scripts/data_movement.py) first leaves the
cluster idle for 10 seconds, then multiplies an array across both workers and persists
32 MB on one worker, then reads it back.
"""

from __future__ import annotations

from conftest import bin_path, otel_env, run_client, start_cluster
from traces import by_trace, orphans

IDLE = "10"  # seconds
SPAN_KIND_CLIENT = 3


def test_transfers_rpcs_and_spilling_in_the_traces_they_serve(receiver, processes):
    env = otel_env(
        receiver,
        DASK_DISTRIBUTED__WORKER__MEMORY__TARGET="0.05",
        DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False",
    )
    worker = [bin_path("dask-worker"), "--memory-limit", "400MB"]
    address = start_cluster(processes, env, [worker, worker])
    observed, _ = run_client(processes, env, address, IDLE, script="data_movement.py")
    assert observed["product_ok"]
    assert observed["total"] == 4_000_000 * 3_999_999 / 2
    assert observed["spilled_keys"] > 0

    names = ("transfer", "rpc get_data", "spill arange", "unspill arange")

    def arrived(r):
        """Every kind of span, and the traces that moved data whole: no span whose parent
        is missing (each process exports on its own schedule; the scheduler's ``graph``
        span, which ends once the client released its keys, may come last). If a parent
        never arrives, the wait fails after 60 s."""
        spans = r.spans()
        moved = [s for s in spans if s["name"] in names]
        kinds = {s["name"] for s in moved} == set(names)
        traces = by_trace(spans)
        whole = all(not orphans(traces[t]) for t in {s["trace_id"] for s in moved})
        return kinds and whole and spans

    spans = receiver.wait_for(arrived, timeout=60)
    tasks = {(s["trace_id"], s["span_id"]): s for s in spans if s["name"].startswith("task ")}

    # An idle cluster (heartbeats, metrics, logs) records no RPC span at all.
    idle_end = observed["idle"][1]
    rpc = [s for s in spans if s["name"].startswith("rpc ")]
    assert rpc
    assert not [s for s in rpc if s["start_ns"] < idle_end], "RPC spans while idle"

    # Every transfer is a child of a task span it served, on the receiving worker; the
    # request it made (rpc get_data) is beneath it.
    for transfer in receiver.spans(name="transfer"):
        assert (transfer["trace_id"], transfer["parent_span_id"]) in tasks
        assert transfer["resource"]["service.name"] == "dask-worker"
        peer = transfer["attributes"]["dask.peer.address"]
        assert peer.startswith("tcp://127.0.0.1:")
        assert peer != transfer["attributes"]["dask.worker.address"]
        assert transfer["attributes"]["dask.transfer.bytes"] > 0
        assert transfer["attributes"]["dask.transfer.outcome"] == "success"
    for request in receiver.spans(name="rpc get_data"):
        assert request["kind"] == SPAN_KIND_CLIENT
        parents = [s for s in spans if s["span_id"] == request["parent_span_id"]]
        assert [p["name"] for p in parents] == ["transfer"]
        assert request["attributes"]["rpc.system.name"] == "dask"
        assert request["attributes"]["server.address"] == "127.0.0.1"
        assert request["attributes"]["server.port"] > 0
    # The sender makes no span: the task that produced the data ended before.
    assert not receiver.spans(name="get_data")

    # Spilling: after the task that produced the data, a trace of its own linked to it.
    for moved in receiver.spans(name="spill arange") + receiver.spans(name="unspill arange"):
        assert not moved["parent_span_id"]
        (link,) = moved["links"]
        producer = tasks[(link["trace_id"], link["span_id"])]
        assert producer["attributes"]["dask.task.key"] == moved["attributes"]["dask.task.key"]
        assert moved["attributes"]["dask.spill.bytes"] >= 250_000 * 8
        assert moved["attributes"]["dask.spill.disk_bytes"] > 0
    reasons = {s["attributes"]["dask.spill.reason"] for s in receiver.spans(name="spill arange")}
    assert reasons <= {"target", "memory-monitor"} and reasons
