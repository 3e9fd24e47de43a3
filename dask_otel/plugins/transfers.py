"""A worker's data movement: ``transfer`` spans and metrics for every dependency fetch.

The sending side makes no span of its own: it serves data after the task that produced
it ended, so no span of that task's trace could hold it, and no trace context travels in
Dask's messages. ``otel.rpc.always-record: [get_data]`` records it as a SERVER root."""

from __future__ import annotations

import asyncio
from itertools import islice
from time import perf_counter, time_ns
from typing import TYPE_CHECKING, Any, ClassVar

from distributed.worker_state_machine import (
    GatherDepBusyEvent,
    GatherDepFailureEvent,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
)
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dask_otel.plugins import rpc
from dask_otel.plugins.worker_patch import InstancePatch, tracing_failed
from dask_otel.spans import ids
from dask_otel.spans.records import DeferredSpan

if TYPE_CHECKING:
    from distributed import Worker

    from dask_otel.config import Settings
    from dask_otel.signals import metrics
    from dask_otel.spans.records import EndedSpans

#: Dependents of the keys a fetch brings that are looked at for traced tasks to serve.
DEPENDENTS_EXAMINED = 256


class TransferTracer(InstancePatch):
    """``transfer`` spans and metrics for every dependency fetch (``gather_dep``).

    The span joins the trace of a task whose inputs it fetched (its ``task`` span is the
    deterministic parent); the other tasks it served are links. While the fetch runs a
    :class:`DeferredSpan` is current (the ``rpc`` spans of the fetch nest under it); the
    worker's emitter builds the span when it is over.
    """

    name = "gather_dep"
    OUTCOMES: ClassVar[dict[type, str]] = {
        GatherDepSuccessEvent: "success",
        GatherDepBusyEvent: "busy",
        GatherDepNetworkFailureEvent: "network_failure",
        GatherDepFailureEvent: "error",
    }

    def __init__(
        self,
        worker: Worker,
        spans: EndedSpans,
        sources: metrics.Sources,
        attributes: dict,
        settings: Settings,
        carriers: ids.TaskCarriers,
    ) -> None:
        super().__init__(worker)
        self.spans = spans
        self.sources = sources
        self.attributes = attributes
        self.settings = settings
        self.carriers = carriers

    async def gather_dep(
        self, worker: str, to_gather: Any, total_nbytes: int, *, stimulus_id: str
    ) -> Any:
        start = perf_counter()
        try:
            started = self._start(worker, to_gather, total_nbytes)
        except Exception:
            tracing_failed()
            started = None
        span = None
        if started is not None:
            span = DeferredSpan(started[0].carrier.context)
            token = context.attach(trace.set_span_in_context(span))
        start_ns = time_ns()
        # Reported on every way out: a fetch cancelled (its worker closing) still has the
        # span that its ``rpc get_data`` request names as parent.
        outcome = "error"  # Dask's gather_dep itself failed
        try:
            result = await self.original(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
            outcome = self.OUTCOMES.get(type(result), "other")
            return result
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if span is not None:
                context.detach(token)
            times = (start_ns, time_ns())
            self.spans.emitter.submit(
                self._report, perf_counter() - start, outcome, total_nbytes, times, started, span
            )

    def _report(
        self,
        seconds: float,
        outcome: str,
        nbytes: int,
        times: tuple[int, int],
        started: tuple[ids.TaskRef, list, dict[str, Any]] | None,
        span: DeferredSpan | None,
    ) -> None:
        """In the emitter thread: the fetch's metric points, and its span if traced."""
        attributes = {**self.attributes, "dask.transfer.outcome": outcome}
        self.sources.transfer_duration.record(seconds, attributes)
        if outcome == "success":
            self.sources.transfer_received.record(nbytes, attributes)
        if started is None or span is None:
            return
        parent, links, span_attributes = started
        span_attributes["dask.transfer.outcome"] = outcome
        if outcome in ("network_failure", "error"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        self.spans.build(
            "transfer", parent, SpanKind.CLIENT, times, span_attributes, None, links, span
        )

    def _start(
        self, peer: str, keys: Any, nbytes: int
    ) -> tuple[ids.TaskRef, list, dict[str, Any]] | None:
        """(the traced task whose inputs are fetched, the others served, the span's
        attributes), or None."""
        if not self.settings.transfer_spans:
            return None  # the metrics above are still recorded
        # Each task once (a task whose inputs come together is every one's dependent), no
        # more than the span can name, and no more than DEPENDENTS_EXAMINED looked at: a
        # key that thousands of (thinned) tasks share is not walked at every fetch.
        wanted = self.settings.max_task_links + 1
        served: dict[str, ids.TaskRef] = {}  # by key
        tasks = self.worker.state.tasks
        dependents = (
            dependent for ts in filter(None, map(tasks.get, keys)) for dependent in ts.dependents
        )
        first = None
        for dependent in islice(dependents, DEPENDENTS_EXAMINED):
            traced = self.carriers.traced(dependent)
            if traced is not None:
                first = first or dependent
                served[traced.key] = traced
                if len(served) == wanted:
                    break
        if not served:
            return None
        # The task's span begins at its first fetch, so that it covers this one.
        self.carriers.fetching(first, time_ns())
        parent, *links = served.values()
        return (
            parent,
            links,
            {
                **self.attributes,
                "dask.peer.address": peer,
                **rpc.peer_attributes(peer, "network.peer"),
                "dask.transfer.keys": len(keys),
                "dask.transfer.bytes": nbytes,
            },
        )
