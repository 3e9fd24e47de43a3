"""Worker plugin: the span of each task attempt (``task <prefix>`` for the one that
produced the result, ``attempt <prefix>`` otherwise), ``transfer`` and ``get_data``.

Every span names its parent by a deterministic id (:mod:`dask_otel.spans.ids`), so no
message is added and nobody waits: an attempt's span is its task's in its generation,
parented to the graph span (or, for an attempt without a result, to the next
generation's span); a fetch (``transfer``) is under the task whose inputs it fetched,
``get_data`` under the task that produced the data sent. The attempt's span is current
while the task runs: ``Worker.execute`` hands contextvars to the executor thread, so
user spans nest under it and user log records carry its ids.

A task's carrier arrives in its ``compute-task`` message's annotations and is taken out
before the worker reads them (:class:`CarrierReceiver`): the task's annotations stay the
user's, its carrier is kept beside it (:class:`dask_otel.spans.ids.TaskCarriers`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from itertools import islice
from time import perf_counter, time_ns
from typing import TYPE_CHECKING, Any, ClassVar

from distributed import core
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import key_split_group
from distributed.worker_state_machine import (
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    GatherDepBusyEvent,
    GatherDepFailureEvent,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
    RescheduleEvent,
)
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dask_otel import runtime
from dask_otel.plugins import client, rpc
from dask_otel.plugins.activation import activate
from dask_otel.plugins.spill import SpillTracer
from dask_otel.runtime import PLUGIN_NAME, report_once
from dask_otel.signals import flight, logs, metrics
from dask_otel.spans import errors, ids
from dask_otel.spans.emitter import drain, off_loop
from dask_otel.spans.records import DeferredSpan, EndedSpans, TaskAttemptSpan

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from distributed import Worker

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: How long a worker keeps asking for the scheduler's id (``dask.cluster.id``).
IDENTITY_TIMEOUT = 60.0
#: Dependents of the keys a fetch brings that are looked at for traced tasks to serve.
DEPENDENTS_EXAMINED = 256


def _tracing_failed() -> None:
    report_once(logger, "worker", "dask-otel: tracing on a worker failed (said once)")


class _InstancePatch:
    """Replaces the method ``name`` of one worker with ``self.<name>``, and back."""

    name: str

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.original: Callable[..., Awaitable[Any]] = getattr(worker, self.name)

    def install(self) -> None:
        setattr(self.worker, self.name, getattr(self, self.name))

    def uninstall(self) -> None:
        if self.worker.__dict__.get(self.name) == getattr(self, self.name):
            delattr(self.worker, self.name)


class CarrierReceiver:
    """Takes each task's carrier out of the annotations of its ``compute-task`` message
    before the worker reads them, and keeps it for the task's ``TaskState``."""

    op = "compute-task"

    def __init__(self, worker: Worker, carriers: ids.TaskCarriers) -> None:
        self.worker = worker
        self.carriers = carriers
        self.original: Callable[..., None] = worker.stream_handlers[self.op]

    def install(self) -> None:
        self.worker.stream_handlers[self.op] = self.compute_task

    def uninstall(self) -> None:
        if self.worker.stream_handlers.get(self.op) == self.compute_task:
            self.worker.stream_handlers[self.op] = self.original

    def compute_task(self, **msg: Any) -> None:
        annotations, carrier = ids.take_carrier(msg.get("annotations"))
        if carrier is None:
            return self.original(**msg)
        msg["annotations"] = annotations
        self.original(**msg)
        # Dask takes a message's annotations only in some of the task's states (not
        # while it runs, say): so does its carrier.
        ts = self.worker.state.tasks.get(msg["key"])
        if ts is not None and ts.annotations is annotations:
            self.carriers.set(ts, carrier)
        return None


class TransferTracer(_InstancePatch):
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
            _tracing_failed()
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
        for dependent in islice(dependents, DEPENDENTS_EXAMINED):
            traced = self.carriers.traced(dependent)
            if traced is not None:
                served[traced.key] = traced
                if len(served) == wanted:
                    break
        if not served:
            return None
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


class GetDataTracer:
    """``get_data`` spans: this worker sending data to a peer, in the producer's trace.

    Nothing nests under them: the event loop notes the times, the emitter builds them.
    """

    def __init__(
        self, worker: Worker, spans: EndedSpans, attributes: dict, carriers: ids.TaskCarriers
    ) -> None:
        self.worker = worker
        self.spans = spans
        self.attributes = attributes
        self.carriers = carriers
        self.original = worker.handlers["get_data"]
        # Dask reads a handler's signature (``comm`` first, ``serializers`` accepted):
        # the handler it calls shows the original's.
        self.handler = functools.update_wrapper(functools.partial(self.get_data), self.original)

    def install(self) -> None:
        self.worker.handlers["get_data"] = self.handler

    def uninstall(self) -> None:
        if self.worker.handlers.get("get_data") is self.handler:
            self.worker.handlers["get_data"] = self.original

    async def get_data(self, comm: Any, **kwargs: Any) -> Any:
        try:
            started = self._start(comm, kwargs.get("keys") or (), kwargs.get("who"))
        except Exception:
            _tracing_failed()
            started = None
        if started is None:
            return await self.original(comm, **kwargs)
        produced, attributes = started
        start = time_ns()
        error = None
        try:
            result = await self.original(comm, **kwargs)
        except BaseException as e:
            errors.hide_frame(e)
            error = e
            raise
        else:
            if isinstance(result, dict) and result.get("status") == "busy":
                attributes["dask.transfer.outcome"] = "busy"
            return result
        finally:
            times = (start, time_ns())
            self.spans.submit("get_data", produced, SpanKind.SERVER, times, attributes, error)
            error = None  # no cycle exception -> traceback -> frame -> error (3.10 keeps it)

    def _start(
        self, comm: Any, keys: Any, who: str | None
    ) -> tuple[ids.TaskRef, dict[str, Any]] | None:
        """(the traced task whose data is sent, the span's attributes), or None."""
        tasks = self.worker.state.tasks
        produced = None
        nbytes = 0
        for key in keys:
            ts = tasks.get(key)
            if ts is None:
                continue
            nbytes += ts.nbytes or 0
            produced = produced or self.carriers.traced(ts)
        if produced is None:
            return None
        peer = who or getattr(comm, "peer_address", "")
        return produced, {
            **self.attributes,
            "dask.peer.address": peer,
            **rpc.peer_attributes(peer, "network.peer"),
            "dask.transfer.keys": len(keys),
            "dask.transfer.bytes": nbytes,
        }


class _Attempt:
    """What the event loop notes about one attempt at running a task; reported later.

    Never the task's result: holding it would keep data alive that Dask let go (spilled
    data would be served from memory by Dask's weak cache, say).
    """

    __slots__ = (
        "annotation",
        "dependencies",
        "end_ns",
        "failure",
        "key",
        "nbytes",
        "outcome",
        "prefix",
        "span",
        "start_ns",
        "state",
        "thread",
        "timing",
    )

    def __init__(
        self, key: Any, prefix: str, annotation: Any, span: DeferredSpan | None, start_ns: int
    ) -> None:
        self.key = key
        self.prefix = prefix
        #: The task's annotation: at the start, then at the end of the attempt (a task
        #: cancelled and asked for again meanwhile has the scheduler's next one).
        self.annotation = annotation
        self.span = span
        self.start_ns = start_ns
        self.end_ns = 0
        self.thread: int | None = None
        #: The worker's state of the task at the end (``cancelled``: released meanwhile).
        self.state: str | None = None
        #: (key, annotation) of its first dependencies, for links (no ``TaskState``: its
        #: ``run_spec`` would keep the dependency's arguments alive).
        self.dependencies: tuple[tuple[Any, Any], ...] = ()
        #: ``success``, ``error`` or ``rescheduled`` (None: something else, e.g. cancelled).
        self.outcome: str | None = None
        #: Dask's own (start, stop) of the run, in seconds since the epoch.
        self.timing: tuple[float, float] | None = None
        #: Size of the result, as Dask measured it.
        self.nbytes: int | None = None
        #: The task's exception as Dask reported it, or one raised by Dask's ``execute``
        #: itself: as text (no frame, argument or exception outlives the attempt).
        self.failure: errors.Failure | None = None

    def note(self, result: Any) -> None:
        """Keep what the reports need from Dask's result."""
        if isinstance(result, RescheduleEvent):
            # Rescheduled by the task (``Reschedule``), or by a closing worker: then the
            # scheduler speaks for the attempt, as for a cancelled one.
            if not result.stimulus_id.startswith("worker-closing"):
                self.outcome = "rescheduled"
        elif isinstance(result, (ExecuteSuccessEvent, ExecuteFailureEvent)):
            self.outcome = "success" if isinstance(result, ExecuteSuccessEvent) else "error"
            if result.start is not None and result.stop is not None:
                self.timing = (result.start, result.stop)
            if isinstance(result, ExecuteSuccessEvent):
                self.nbytes = result.nbytes
            else:
                self.failure = errors.failure(
                    result.exception, result.exception_text, result.traceback_text
                )


class ExecuteTracer(_InstancePatch):
    """Replaces one worker's ``execute``: the span of each traced attempt and a
    ``dask.task.duration`` point per attempt.

    On the event loop, a traced attempt only makes a :class:`DeferredSpan` current (user
    spans, logs and ``rpc`` spans in the task see it) and notes the outcome; the span and
    the metric point are made by the worker's emitter thread: the ``task`` span if the
    attempt produced the result, an ``attempt`` span if it failed or was rescheduled
    (trace model v2, :mod:`dask_otel.spans.ids`); with ``otel.scheduler.task-spans: all`` an
    ``execute`` span under the scheduler's ``task`` span.
    """

    name = "execute"

    def __init__(
        self,
        worker: Worker,
        tracer: trace.Tracer,
        task_duration: Any,
        settings: Settings,
        carriers: ids.TaskCarriers,
    ) -> None:
        super().__init__(worker)
        self.tracer = tracer
        self.carriers = carriers
        #: Builds this worker's spans (``execute`` and the ended spans of its other work).
        self.spans = rpc.ended_spans(tracer, settings)
        self.task_duration = task_duration
        self.settings = settings
        #: Attributes of every span; ``dask.cluster.id`` joins once the scheduler answers.
        self.static_attributes = {
            "dask.worker.address": worker.address,
            "dask.worker.name": ids.cap(str(worker.name), settings.max_attribute_length),
        }
        #: Where the attempts in progress are noted for this worker's Nanny, if any.
        self.recorder = flight.open_for(worker, settings.flight_recorder_size)
        if self.recorder is not None:
            from dask_otel.distro import mirror  # imports the SDK: not at import time

            mirror.mirror(self.recorder)  # this process's export queues, copied to it

    async def execute(self, key: Any, *, stimulus_id: str) -> Any:
        ts = self.worker.state.tasks.get(key)
        if ts is None:  # Dask ignores it; so do we
            return await self.original(key, stimulus_id=stimulus_id)
        carriers = self.carriers
        annotation = carriers.get(ts)
        carrier = ids.parse(annotation)
        span = None
        if carrier is not None and carrier.context.trace_flags.sampled:
            span = (
                DeferredSpan(carrier.context)
                if carrier.scheduler_spans or carrier.from_client
                else TaskAttemptSpan(carrier, key)
            )
            token = context.attach(trace.set_span_in_context(span))
        attempt = _Attempt(key, ts.prefix, annotation, span, time_ns())
        recorder = self.recorder
        if recorder is not None:  # for the Nanny, should this process die during the attempt
            text = ids.cap(ids.key_to_str(key), self.settings.max_attribute_length)
            slot = recorder.started(text, ts.prefix, annotation, ts.run_id, attempt.start_ns)
        try:
            result = await self.original(key, stimulus_id=stimulus_id)
        except BaseException as e:
            # Dask's execute handles task errors itself: this is Dask failing (or cancelled).
            errors.hide_frame(e)
            attempt.failure = errors.failure(e)
            raise
        else:
            attempt.note(result)
            return result
        finally:
            if span is not None:
                context.detach(token)
            if recorder is not None:
                recorder.ended(slot)
            attempt.end_ns = time_ns()
            attempt.thread = self.worker.threads.get(key)
            attempt.state = ts.state
            if carrier is not None:
                attempt.annotation = carriers.get(ts)
                if attempt.outcome == "success" and not carrier.scheduler_spans:
                    attempt.dependencies = tuple(
                        (dts.key, carriers.get(dts))
                        for dts in islice(ts.dependencies, self.settings.max_task_links)
                    )
            self.spans.emitter.submit(self._report, attempt)
            if recorder is not None:
                self.spans.emitter.submit(recorder.reported, slot)

    # -- the emitter thread -----------------------------------------------------------------

    def _report(self, attempt: _Attempt) -> None:
        """The attempt's duration point, and its span if traced (or thinned but kept)."""
        prefix = ids.cap(attempt.prefix, self.settings.max_attribute_length)
        timing = attempt.timing
        if timing is not None:
            self._record_duration(prefix, attempt.outcome, timing)  # type: ignore[arg-type]
        carrier = ids.parse(attempt.annotation)
        if carrier is None:
            return
        if carrier.scheduler_spans:
            kept = timing is not None and carrier.thinned and self._keep_anyway(attempt)
            if attempt.span is not None or kept:
                self._emit(attempt, f"execute {prefix}", carrier, carrier.span_id, None, None)
            return
        if attempt.state == "cancelled" or attempt.outcome is None:
            return  # the scheduler emits what stands for it: the cancelled task, the lost attempt
        if attempt.span is None and not (
            timing is not None and carrier.thinned and self._keep_anyway(attempt)
        ):
            return
        name = f"{'task' if attempt.outcome == 'success' else 'attempt'} {prefix}"
        if carrier.from_client:
            # No dask-otel scheduler: each attempt with an id of its own, under the client's.
            self._emit(attempt, name, carrier, None, None, None)
        elif attempt.outcome == "success":
            links = self._links(attempt, carrier)
            self._emit(attempt, name, carrier, None, links, carrier.span_id)
        else:  # failed or rescheduled: under the span of the next generation
            self._emit(attempt, name, carrier, carrier.next_span_id, None, carrier.span_id)

    def _keep_anyway(self, attempt: _Attempt) -> bool:
        """A thinned task's attempt is reported if it failed or was slow."""
        start, stop = attempt.timing  # type: ignore[misc]
        return attempt.outcome == "error" or stop - start > self.settings.keep_slower_than

    def _emit(
        self,
        attempt: _Attempt,
        name: str,
        carrier: ids.Carrier,
        parent_id: Callable[[str], int] | None,
        links: list[trace.Link] | None,
        span_id: Callable[[str], int] | None,
    ) -> None:
        """The attempt's span, named ``name``: its parent the span ``parent_id`` names
        (None: the carrier's), its id the one ``span_id`` names (None: the current span's,
        or a new one)."""
        key = ids.key_to_str(attempt.key)
        limit = self.settings.max_attribute_length
        context = ids.with_sampled(carrier.context, True)  # a thinned task kept anyway
        parent = (
            context
            if parent_id is None
            else trace.SpanContext(context.trace_id, parent_id(key), True, context.trace_flags)
        )
        if attempt.span is not None:
            start, end = attempt.start_ns, attempt.end_ns
        else:  # timed by Dask (nothing nested under it: it was not current)
            start, end = (int(t * 1e9) for t in attempt.timing)  # type: ignore[union-attr]
        final: dict[str, Any] = {}
        if attempt.thread is not None:
            final["thread.id"] = attempt.thread
        if attempt.outcome == "rescheduled":
            final["dask.task.rescheduled"] = True
        if attempt.nbytes is not None and parent_id is None:
            final["dask.task.nbytes"] = attempt.nbytes
        if attempt.timing is not None:
            final["dask.task.compute_seconds"] = max(0.0, attempt.timing[1] - attempt.timing[0])
        if carrier.generation:
            final["dask.task.generation"] = carrier.generation
        self.spans.build(
            name,
            parent,
            SpanKind.INTERNAL,
            (start, end),
            {
                **self.static_attributes,
                "dask.task.key": ids.cap(key, limit),
                "dask.task.prefix": ids.cap(attempt.prefix, limit),
                "dask.task.group": ids.cap(key_split_group(attempt.key), limit),
            },
            attempt.failure,
            links=links,
            deferred=attempt.span,
            final=final,
            span_id=span_id(key) if span_id is not None else None,
        )

    @staticmethod
    def _links(attempt: _Attempt, carrier: ids.Carrier) -> list[trace.Link]:
        """Links to the spans of the task's dependencies: as the scheduler named them, or
        derived from their keys (same graph; in a thinned graph only those known here)."""
        relation = {"dask.link": "dependency"}
        if carrier.links is not None:
            return [trace.Link(link, relation) for link in carrier.links]
        links = []
        for key, annotation in attempt.dependencies:
            ref = ids.task_ref(annotation, key)
            if ref is None and not carrier.partial:
                ref = ids.TaskRef(carrier._replace(generation=0), ids.key_to_str(key))
            if ref is not None:
                links.append(trace.Link(ref.span_context, relation))
        return links

    def _record_duration(self, prefix: str, outcome: str, timing: tuple[float, float]) -> None:
        """One ``dask.task.duration`` point per attempt, traced or not (Dask's timings)."""
        self.task_duration.record(
            max(0.0, timing[1] - timing[0]),
            {**self.static_attributes, "dask.task.prefix": prefix, "dask.task.outcome": outcome},
        )

    async def fetch_cluster_id(self) -> None:
        """Learn the scheduler's id, off the worker's start-up path, on a connection of
        its own that closes after: left in the worker's pool, it would be the one the
        worker's first heartbeat opens plain, and that heartbeat would change."""
        worker = self.worker
        try:
            async with core.rpc(
                worker.scheduler.address, connection_args=worker.connection_args
            ) as scheduler:
                identity = await asyncio.wait_for(scheduler.identity(n_workers=0), IDENTITY_TIMEOUT)
        except Exception as e:
            logger.warning("dask-otel: cannot read the scheduler's id, spans lack it: %r", e)
            return
        self.static_attributes["dask.cluster.id"] = identity["id"]
        logs.add_cluster(identity["id"])


class DaskOtelWorkerPlugin(WorkerPlugin):
    """Traces task execution on every worker it reaches (pickled to remote workers)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._tracer: ExecuteTracer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    async def setup(self, worker: Worker) -> None:
        settings = activate("worker", worker)
        if settings is None:
            return
        self._providers = runtime.current()
        self._settings = settings
        meter_provider = self._meter_provider = metrics.meter_provider(self._providers, settings)
        sources = metrics.sources(meter_provider)
        carriers = ids.TaskCarriers()
        self._tracer = ExecuteTracer(
            worker, self._providers.tracer(), sources.task_duration, settings, carriers
        )
        attributes = self._tracer.static_attributes
        tracer = self._tracer.tracer
        limit = settings.max_attribute_length
        ended = self._tracer.spans
        self._patches = [
            CarrierReceiver(worker, carriers),
            self._tracer,
            TransferTracer(worker, ended, sources, attributes, settings, carriers),
        ]
        if settings.transfer_spans:
            self._patches.append(GetDataTracer(worker, ended, attributes, carriers))
        if settings.spill_spans and SpillTracer.applies(worker):
            self._patches.append(SpillTracer(worker, ended, attributes, limit, carriers))
        for patch in self._patches:
            patch.install()
        self._handlers = rpc.trace_handlers(worker, tracer, settings)
        # Tasks that submit tasks (``worker_client``) trace the submission in their own
        # trace, whichever way dask-otel came into this process.
        client.trace_submissions(client.IN_TASKS)
        metrics.observe_worker(meter_provider, worker, self._tracer.static_attributes)
        logs.add_worker(worker.address)
        self._identity = asyncio.create_task(self._tracer.fetch_cluster_id())

    def flush(self, timeout: float) -> bool:
        """Wait until every span this plugin recorded so far was emitted (tests and
        benchmarks); False on timeout."""
        return self._tracer is None or self._tracer.spans.emitter.flush(timeout)

    async def teardown(self, worker: Worker) -> None:
        if self._tracer is None:
            return
        # The reverse of setup: the rpc wrappers went around the patched handlers.
        client.untrace_submissions(client.IN_TASKS)
        worker.handlers.update(self._handlers)
        for patch in self._patches:
            patch.uninstall()
        closing = self._tracer.spans.emitter
        attributes = self._tracer.static_attributes
        if self._tracer.recorder is not None:
            from dask_otel.distro import mirror

            mirror.mirror(None)
            self._tracer.recorder.close()  # closed normally: its recorder is deleted
        self._tracer = None
        self._identity.cancel()
        budget = self._settings.flush_timeout
        if worker.nanny is not None:  # which kills its worker if it takes 4 s to close
            budget = runtime.closing_under_nanny(budget)
        # The last collection still reads this worker: flush first, then let it go.
        await off_loop(drain, closing, self._providers, budget)
        metrics.forget(self._meter_provider, worker)
        logs.remove_worker(worker.address)
        if "dask.cluster.id" in attributes:  # the scheduler answered: named above
            logs.remove_cluster(attributes["dask.cluster.id"])
