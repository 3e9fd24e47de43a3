"""Checks on the spans of an in-process cluster as the SDK hands them over in memory
(``telemetry`` fixture): how a trace hangs together, which plugins run."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import dask
from distributed import Client, LocalCluster

from dask_otel.spans import ids


@contextmanager
def cluster_and_client(**kwargs) -> Iterator[tuple[LocalCluster, Client]]:
    options = {
        "n_workers": 2,
        "threads_per_worker": 1,
        "processes": False,
        "dashboard_address": "127.0.0.1:0",
        **kwargs,
    }
    # No work stealing: a stolen task has extra states and attempts, which would make the
    # exact expectations below depend on timing.
    with dask.config.set({"distributed.scheduler.work-stealing": False}):
        cluster = LocalCluster(**options)
    with cluster, Client(cluster) as client:
        yield cluster, client


def inc(x):
    return x + 1


def fail(x):
    raise ValueError(f"boom {x}")


def by_trace(spans) -> dict[int, list]:
    traces = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    return traces


def only(spans, name: str):
    (span,) = [s for s in spans if s.name == name]
    return span


def task_spans_by_key(spans) -> dict[str, object]:
    """The task span of each key (of its latest generation, if it was computed again)."""
    out: dict[tuple[str, int], object] = {}
    for span in spans:
        if span.name.startswith("task "):
            key = (span.attributes["dask.task.key"], span.attributes.get("dask.task.generation", 0))
            assert key not in out, f"two task spans for {key}"
            out[key] = span
    return {key: span for (key, _), span in sorted(out.items(), key=lambda kv: kv[0][1])}


def graph_of(spans, trace_id):
    """The graph span of a trace: the context every task of it carries."""
    (graph,) = [
        s
        for s in spans
        if s.context.trace_id == trace_id and s.name.split(" ")[0] == "graph"  # or `graph <name>`
    ]
    return graph


def carrier_of(spans, trace_id):
    return graph_of(spans, trace_id).context


def assert_task_ids_line_up(spans) -> None:
    """Each task and attempt span has the id derived from (graph, key, generation) and the
    graph as parent: attempts lie beside the task's span, each within the graph's time;
    the task's span links to its earlier attempts' spans."""
    tasks = task_spans_by_key(spans)
    assert tasks
    for span in spans:
        if not span.name.startswith(("task ", "attempt ")):
            continue
        key = span.attributes["dask.task.key"]
        carrier = carrier_of(spans, span.context.trace_id)
        generation = span.attributes.get("dask.task.generation", 0)
        assert span.context.span_id == ids.task_span_id(carrier, key, generation), span.name
        assert span.name.split(" ", 1)[1] == span.attributes["dask.task.prefix"]
        assert span.parent.span_id == carrier.span_id, span.name
        if span.name.startswith("task ") and generation:
            earlier = [
                link.context.span_id
                for link in span.links
                if link.attributes.get("dask.link") == "earlier-attempt"
            ]
            first = max(0, generation - ids.MAX_EARLIER_ATTEMPT_LINKS)
            assert earlier == [ids.task_span_id(carrier, key, g) for g in range(first, generation)]


def assert_no_orphans(spans) -> None:
    """Every parent resolves inside its trace, and no span id is used twice in one."""
    present = [(s.context.trace_id, s.context.span_id) for s in spans]
    assert len(present) == len(set(present)), "a span id used twice"
    for span in spans:
        if span.parent is not None:
            assert span.parent.trace_id == span.context.trace_id
            assert (span.parent.trace_id, span.parent.span_id) in set(present), span.name


def scheduler_plugins(client: Client) -> list[str]:
    return client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))


def worker_plugins(client: Client) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: list(dask_worker.plugins))
