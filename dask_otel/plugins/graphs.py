"""A ``graph`` span per ``update_graph``, which tasks of it dask-otel traces, and the
counts of their final states, which end the span when its last task is done."""

from __future__ import annotations

import logging
from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from dask_otel import strings
from dask_otel.plugins import carriers
from dask_otel.plugins.scheduler_spans import Graph
from dask_otel.spans import ids, naming

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import Settings
    from dask_otel.plugins.carriers import Carriers
    from dask_otel.spans.emitter import SpanEmitter

logger = logging.getLogger(__name__)


class Graphs:
    """The open graphs of one scheduler, and the open graph of each of their tasks until
    it reaches a final state; :meth:`close` ends what is still open."""

    def __init__(
        self,
        settings: Settings,
        tracer: trace.Tracer,
        cluster_id: str,
        carriers: Carriers,
        emitter: SpanEmitter,
    ) -> None:
        self._settings = settings
        self._tracer = tracer
        self._cluster_id = cluster_id
        self._carriers = carriers
        self._emitter = emitter
        #: The open graph of each task not yet in a final state.
        self._of_task: dict[Any, Graph] = {}
        self._open: set[Graph] = set()
        #: Open graphs by the span id their tasks carry.
        self._by_span: dict[int, Graph] = {}

    @property
    def tasks(self) -> int:
        """Tasks of open graphs not yet in a final state."""
        return len(self._of_task)

    def __len__(self) -> int:
        return len(self._open)

    def by_span(self, span_id: int) -> Graph | None:
        """The open graph whose tasks carry ``span_id``."""
        return self._by_span.get(span_id)

    def pop_task(self, key: Any) -> Graph | None:
        """The open graph of ``key``, which has reached its final state."""
        return self._of_task.pop(key, None)

    def queued(self, key: Any) -> None:
        graph = self._of_task.get(key)
        if graph is not None:
            graph.counts["queued"] += 1

    def count(self, graph: Graph, state: str) -> None:
        """One task of ``graph`` reached the final ``state``; the last one ends it."""
        graph.counts[state] += 1
        graph.pending -= 1
        if graph.pending == 0:
            self._close(graph, time_ns())

    def _close(self, graph: Graph, now: int) -> None:
        self._open.discard(graph)
        self._by_span.pop(graph.carrier.context.span_id, None)
        self._emitter.submit(graph.end, now)

    def close(self) -> None:
        """Stop counting (transitions from now on find no graph) and end the open graphs'
        spans as incomplete."""
        self._of_task = {}
        now = time_ns()
        for graph in list(self._open):
            graph.span.set_attribute("dask.graph.incomplete", True)
            self._close(graph, now)

    def update_graph(
        self, scheduler: Scheduler, client: str, keys: set[Any], tasks: list[Any]
    ) -> None:
        """Start the span of the graph ``update_graph`` is adding, and give the tasks it
        created their carriers (a graph that created none ends at once)."""
        submitted = carriers.submitted()
        parent = submitted.context if submitted is not None else None
        now = time_ns()
        span = self._tracer.start_span(
            "graph"
            if parent
            else naming.graph_name(keys, scheduler.tasks, self._settings.max_attribute_length),
            # A root needs an explicit empty context: never adopt what the loop has current.
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent))
            if parent
            else Context(),
            kind=SpanKind.CONSUMER if parent else SpanKind.INTERNAL,
            start_time=now,
            attributes={
                "dask.cluster.id": self._cluster_id,
                "dask.client.id": client,
                "dask.graph.keys": len(keys),
            },
        )
        if not span.is_recording():
            span.end(now)
            return
        graph = Graph(span, now)
        try:
            created = self._annotate(graph, scheduler, tasks)
        except Exception:
            # Never leave the graph span open nor fail Dask's update_graph.
            logger.exception("dask-otel: tracing a graph failed")
            created = 0
        graph.pending = created
        span.set_attribute("dask.graph.tasks", created)
        if created:
            self._open.add(graph)
            self._by_span[graph.carrier.context.span_id] = graph
        else:
            self._emitter.submit(graph.end, now)

    def _annotate(self, graph: Graph, scheduler: Scheduler, tasks: list[Any]) -> int:
        """Give the tasks this graph created its carrier; return how many."""
        open_tasks = self._of_task
        states = scheduler.tasks
        created = []
        for key in tasks:
            ts = states.get(key)
            # Only tasks this graph created are still released; the others (scattered
            # data, results of earlier graphs, running tasks) belong to other spans.
            if ts is None or ts.state != "released" or key in open_tasks:
                continue
            carrier = self._carriers.of(ts)
            if carrier is not None and carrier.context.span_id in self._by_span:
                continue  # created by an earlier graph still open: its span lives there
            created.append(ts)
        settings = self._settings
        filtered = settings.include_prefixes or settings.exclude_prefixes
        # The prefix filters choose first; the span budget is shared by the tasks they keep.
        chosen = [not filtered or self._prefix_traced(ts.prefix.name) for ts in created]
        ratio = self._span_ratio(sum(chosen))
        partial = ratio < 1 or not all(chosen)
        carrier = graph.carrier._replace(partial=partial)
        kept_annotation = carrier.encode()
        thinned_annotation = carrier._replace(
            context=ids.with_sampled(carrier.context, False), thinned=settings.task_spans
        ).encode()
        created_set = {ts.key for ts in created}
        for ts, kept in zip(created, chosen, strict=True):
            key_text = strings.key_to_str(ts.key)
            if kept and ratio < 1:
                kept = ids.keep_task(carrier.context, key_text, ratio)
            annotation = kept_annotation if kept else thinned_annotation
            if kept and ts.dependencies:
                annotation = self._with_foreign_links(carrier, ts, created_set) or annotation
            # The carrier's sampled flag tells the worker whether to trace the task.
            self._carriers.set(ts.key, annotation)
            open_tasks[ts.key] = graph
        if ratio < 1:
            graph.span.set_attribute("dask.graph.span_ratio", ratio)
        return len(created)

    def _with_foreign_links(self, carrier: ids.Carrier, ts: Any, created: set[Any]) -> str | None:
        """The annotation naming the task spans of ``ts``'s dependencies, if one of them
        is not of this graph (the worker derives the others from their keys)."""
        dependencies = list(islice(ts.dependencies, self._settings.max_task_links))
        if all(dts.key in created for dts in dependencies):
            return None
        links = []
        for dts in dependencies:
            if dts.key in created:
                links.append(ids.TaskRef(carrier, strings.key_to_str(dts.key)).span_context)
                continue
            ref = ids.task_ref(self._carriers.annotation(dts.key), dts.key)
            if ref is not None:
                links.append(ref.span_context)
        return carrier._replace(links=tuple(links)).encode()

    def _span_ratio(self, tasks: int) -> float:
        """Share of a graph's tasks that get per-task spans (``otel.task.*``)."""
        settings = self._settings
        ratio = settings.task_sample_ratio if settings.task_spans else 0.0
        if tasks * ratio > settings.max_spans_per_graph:
            ratio = settings.max_spans_per_graph / tasks
        return ratio

    def _prefix_traced(self, prefix: str) -> bool:
        settings = self._settings
        if settings.include_prefixes and prefix not in settings.include_prefixes:
            return False
        return prefix not in settings.exclude_prefixes
