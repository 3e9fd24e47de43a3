"""Instrumentation leaves a user's annotations as the user wrote them.

distributed's own test_client.py::test_annotations_global_vs_local and
::test_computation_store_annotations, and test_spans.py::test_spans and
::test_mismatched_span, failed under ``opentelemetry-instrument`` while the trace context
rode in every task's annotations (an ``otel`` entry): the scheduler's tasks, its
``Computation`` records, what scheduler plugins get in ``update_graph`` and the workers'
tasks showed an annotation nobody wrote. The carrier now travels beside them.
"""

from __future__ import annotations

from typing import Any

import dask
import distributed
from conftest import in_process_cluster, instrumented
from distributed.diagnostics.plugin import SchedulerPlugin


def inc(x: int) -> int:
    return x + 1


class RecordAnnotations(SchedulerPlugin):
    """What a scheduler plugin is given in ``update_graph``."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def update_graph(self, scheduler: Any, *, annotations: dict, **kwargs: Any) -> None:
        self.seen.append({name: dict(by_key) for name, by_key in annotations.items()})


def annotations_seen(span: str | None = None) -> dict[str, Any]:
    """What the scheduler, a scheduler plugin and the worker hold of a computation the
    user annotated (inside Dask's ``span`` named ``span``, if given)."""
    with in_process_cluster(n_workers=1) as client:
        client.register_plugin(RecordAnnotations(), name="record-annotations")
        with dask.annotate(job="very-important"):
            if span is None:
                future = client.compute(dask.delayed(inc)(1, dask_key_name="x"))
            else:
                with distributed.span(span):
                    future = client.compute(dask.delayed(inc)(1, dask_key_name="x"))
        assert future.result() == 2

        def scheduler(dask_scheduler: Any) -> dict[str, Any]:
            return {
                "task": dask_scheduler.tasks["x"].annotations,
                "computation": dask_scheduler.computations[-1].annotations,
                "plugin": dask_scheduler.plugins["record-annotations"].seen,
            }

        def worker(dask_worker: Any) -> dict[str, Any]:
            return dask_worker.state.tasks["x"].annotations

        (on_worker,) = client.run(worker).values()
        return {**client.run_on_scheduler(scheduler), "worker": on_worker}


def test_annotations_are_the_users_own() -> None:
    plain = annotations_seen()
    assert plain == {
        "task": {"job": "very-important"},
        "computation": {"job": "very-important"},
        "plugin": [{"job": {"x": "very-important"}}],
        "worker": {"job": "very-important"},
    }
    with instrumented() as telemetry:
        assert annotations_seen() == plain
    # ... and the computation was traced all the same, its task under its graph.
    (task,) = telemetry.spans("task x")
    (graph,) = telemetry.spans("graph")
    assert task.parent.span_id == graph.context.span_id


def without_span_ids(seen: dict[str, Any]) -> dict[str, Any]:
    """``seen`` with Dask's span ids (new at every run) replaced by their count."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: len(v) if k == "ids" else strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(seen)


def test_dask_spans_annotations_are_untouched() -> None:
    """Dask's own ``span`` annotation (its spans extension reads and rewrites it)."""
    plain = without_span_ids(annotations_seen(span="workflow"))
    assert plain["worker"] == {"job": "very-important", "span": {"name": ("workflow",), "ids": 1}}
    with instrumented() as telemetry:
        assert without_span_ids(annotations_seen(span="workflow")) == plain
    assert telemetry.spans("task x")
