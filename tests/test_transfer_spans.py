"""Transfers between workers and the ``get_data`` requests that serve them, in the
traces of the tasks they served, within those tasks' spans."""

from __future__ import annotations

import pytest
from conftest import flush_emitters
from opentelemetry.trace import SpanKind
from span_checks import assert_no_orphans, cluster_and_client, fail, inc, only

# -- transfers ------------------------------------------------------------------------------


def test_a_transfer_lies_within_the_task_it_fetched_for(telemetry):
    with cluster_and_client() as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, workers=[a], key="x-1")
        y = client.submit(inc, x, workers=[b], key="y-1")
        assert y.result() == 3
        flush_emitters(client)

    spans = telemetry.spans()
    task_y = only(spans, "task y")
    transfer = only(spans, "transfer")
    # Fetching y's input on worker b: in y's trace, under y's task span, within it.
    assert transfer.parent.span_id == task_y.context.span_id
    assert transfer.context.trace_id == task_y.context.trace_id
    assert task_y.start_time <= transfer.start_time <= transfer.end_time <= task_y.end_time
    assert transfer.kind == SpanKind.CLIENT
    assert transfer.attributes["dask.worker.address"] == b
    assert transfer.attributes["dask.peer.address"] == a
    assert transfer.attributes["dask.transfer.keys"] == 1
    assert transfer.attributes["dask.transfer.outcome"] == "success"
    # The request it made: a CLIENT span beneath it (the client's own gather is untraced).
    request = only(spans, "rpc get_data")
    assert request.parent.span_id == transfer.context.span_id
    assert request.kind == SpanKind.CLIENT
    assert request.attributes["server.address"] == a  # inproc://: no host and port
    # Sending x from worker a makes no span: x's span ended before; nothing could hold it.
    assert not [s for s in spans if s.name == "get_data"]


def test_a_transfer_serving_one_task_links_to_nothing(telemetry):
    """Both inputs of one task fetched together: the transfer's parent is that task, and
    it links to no task twice (nor to its own parent)."""
    with cluster_and_client() as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        x1 = client.submit(inc, 1, workers=[a], key="x-1")
        x2 = client.submit(inc, 2, workers=[a], key="x-2")
        assert client.gather([x1, x2]) == [2, 3]
        z = client.submit(sum, [x1, x2], workers=[b], key="z-1")
        assert z.result() == 5
        flush_emitters(client)

    spans = telemetry.spans()
    transfer = only(spans, "transfer")
    assert transfer.attributes["dask.transfer.keys"] == 2
    assert transfer.parent.span_id == only(spans, "task z").context.span_id
    assert not transfer.links


@pytest.mark.parametrize(
    "keys", [((1, 2), (3, 4)), (((1, 2), "a"), ((3, 4), "b")), (("x", 1), ("y", 1))]
)
def test_keys_of_any_type_keep_the_transfer_under_its_task(telemetry, keys):
    """Tuple keys whose first element is not a string (an int, a tuple): the task spans
    are built, their group named as the scheduler names it, and the transfer and its
    request keep their parents."""
    with cluster_and_client() as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(inc, 1, workers=[a], key=keys[0])
        y = client.submit(inc, x, workers=[b], key=keys[1])
        assert y.result() == 3
        groups = client.run_on_scheduler(
            lambda dask_scheduler: {
                str(k): str(ts.group.name) for k, ts in dask_scheduler.tasks.items()
            }
        )
        with pytest.raises(ValueError):  # its task span is the scheduler's
            client.submit(fail, 1, key=(keys[0][0], "failed")).result()
        flush_emitters(client)

    spans = telemetry.spans()
    tasks = [s for s in spans if s.name.startswith("task ")]
    failed = str((keys[0][0], "failed"))
    assert {s.attributes["dask.task.key"]: s.attributes["dask.task.group"] for s in tasks} == {
        **groups,
        failed: str(keys[0][0]),
    }
    assert only(spans, "transfer").parent.span_id in {s.context.span_id for s in tasks}
    assert_no_orphans(spans)
