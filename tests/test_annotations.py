"""Instrumentation leaves a user's annotations as the user wrote them.

distributed's own test_client.py::test_annotations_global_vs_local and
::test_computation_store_annotations fail under ``opentelemetry-instrument``: the trace
context rides in every task's annotations (an ``otel`` entry), so the scheduler's tasks,
its ``Computation`` records and the workers' tasks show an annotation nobody wrote, to
the user, to scheduler and worker plugins, and to the dashboard.
"""

from __future__ import annotations

from typing import Any

import dask
import pytest
from conftest import in_process_cluster, instrumented


def inc(x: int) -> int:
    return x + 1


def annotations_seen() -> dict[str, Any]:
    """What the scheduler and the worker hold of a computation the user annotated."""
    with in_process_cluster(n_workers=1) as client:
        with dask.annotate(job="very-important"):
            future = client.compute(dask.delayed(inc)(1, dask_key_name="x"))
        assert future.result() == 2

        def scheduler(dask_scheduler: Any) -> dict[str, Any]:
            return {
                "task": dask_scheduler.tasks["x"].annotations,
                "computation": dask_scheduler.computations[-1].annotations,
            }

        def worker(dask_worker: Any) -> dict[str, Any]:
            return dask_worker.state.tasks["x"].annotations

        (on_worker,) = client.run(worker).values()
        return {**client.run_on_scheduler(scheduler), "worker": on_worker}


@pytest.mark.xfail(
    strict=True,
    reason="issue 21: the trace context rides in task annotations (dask_otel/ids.py, "
    "client.py, scheduler.py), visible in TaskState.annotations and Computation.annotations",
)
def test_annotations_are_the_users_own() -> None:
    plain = annotations_seen()
    assert plain == {
        "task": {"job": "very-important"},
        "computation": {"job": "very-important"},
        "worker": {"job": "very-important"},
    }
    with instrumented():
        assert annotations_seen() == plain
