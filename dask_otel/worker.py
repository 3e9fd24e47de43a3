"""Worker plugin: ``execute <prefix>`` per task attempt, ``transfer`` and ``get_data``.

Each span's parent is a ``task`` span on the scheduler, named by its deterministic id, so
no message is added and nobody waits: the task that ran (``execute``), a task whose
inputs were fetched (``transfer``), the task that produced the data sent (``get_data``).
``execute`` is current while the task runs: ``Worker.execute`` hands contextvars to the
executor thread, so user spans nest under it and user log records carry its ids.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import traceback
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar

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

from dask_otel import errors, ids, logs, metrics, rpc, telemetry
from dask_otel.activation import activate
from dask_otel.report import report_once
from dask_otel.spill import SpillTracer
from dask_otel.telemetry import PLUGIN_NAME

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from distributed import Worker

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: How long a worker keeps asking for the scheduler's id (``dask.cluster.id``).
IDENTITY_TIMEOUT = 60.0


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


class TransferTracer(_InstancePatch):
    """``transfer`` spans and metrics for every dependency fetch (``gather_dep``).

    The span joins the trace of a task whose inputs it fetched (its ``task`` span is the
    deterministic parent); the other tasks it served are links.
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
        tracer: trace.Tracer,
        sources: metrics.Sources,
        attributes: dict,
        settings: Settings,
    ) -> None:
        super().__init__(worker)
        self.tracer = tracer
        self.sources = sources
        self.attributes = attributes
        self.settings = settings

    async def gather_dep(
        self, worker: str, to_gather: Any, total_nbytes: int, *, stimulus_id: str
    ) -> Any:
        start = perf_counter()
        try:
            span = self._start(worker, to_gather, total_nbytes)
        except Exception:
            _tracing_failed()
            span = None
        token = context.attach(trace.set_span_in_context(span)) if span is not None else None
        try:
            result = await self.original(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
        finally:
            if token is not None:
                context.detach(token)
        outcome = self.OUTCOMES.get(type(result), "other")
        attributes = {**self.attributes, "dask.transfer.outcome": outcome}
        try:
            self.sources.transfer_duration.record(perf_counter() - start, attributes)
            if outcome == "success":
                self.sources.transfer_received.record(total_nbytes, attributes)
            if span is not None:
                span.set_attribute("dask.transfer.outcome", outcome)
                if outcome in ("network_failure", "error"):
                    span.set_status(Status(StatusCode.ERROR, outcome))
                span.end()
        except Exception:
            _tracing_failed()
        return result

    def _start(self, peer: str, keys: Any, nbytes: int) -> trace.Span | None:
        if not self.settings.transfer_spans:
            return None  # the metrics above are still recorded
        served = []
        tasks = self.worker.state.tasks
        for key in keys:
            ts = tasks.get(key)
            for dependent in ts.dependents if ts is not None else ():
                traced = ids.traced_task(dependent.annotations, dependent.key)
                if traced is not None:
                    served.append(traced)
            if len(served) > self.settings.max_task_links:
                break
        if not served:
            return None
        (carrier, key), others = served[0], served[1 : self.settings.max_task_links + 1]
        return self.tracer.start_span(
            "transfer",
            context=ids.task_context(carrier, key),
            kind=SpanKind.CLIENT,
            links=[ids.task_link(c, k, "served") for c, k in others],
            attributes={
                **self.attributes,
                "dask.peer.address": peer,
                **rpc.peer_attributes(peer, "network.peer"),
                "dask.transfer.keys": len(keys),
                "dask.transfer.bytes": nbytes,
            },
        )


class GetDataTracer:
    """``get_data`` spans: this worker sending data to a peer, in the producer's trace."""

    def __init__(self, worker: Worker, tracer: trace.Tracer, attributes: dict, limit: int) -> None:
        self.worker = worker
        self.tracer = tracer
        self.attributes = attributes
        self.limit = limit
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
            span = self._start(comm, kwargs.get("keys") or (), kwargs.get("who"))
        except Exception:
            _tracing_failed()
            span = None
        if span is None:
            return await self.original(comm, **kwargs)
        try:
            result = await self.original(comm, **kwargs)
        except BaseException as e:
            errors.record_exception(span, e, None, None, self.limit)
            raise
        else:
            if isinstance(result, dict) and result.get("status") == "busy":
                span.set_attribute("dask.transfer.outcome", "busy")
            return result
        finally:
            span.end()

    def _start(self, comm: Any, keys: Any, who: str | None) -> trace.Span | None:
        tasks = self.worker.state.tasks
        produced = None
        nbytes = 0
        for key in keys:
            ts = tasks.get(key)
            if ts is None:
                continue
            nbytes += ts.nbytes or 0
            produced = produced or ids.traced_task(ts.annotations, key)
        if produced is None:
            return None
        peer = who or getattr(comm, "peer_address", "")
        return self.tracer.start_span(
            "get_data",
            context=ids.task_context(*produced),
            kind=SpanKind.SERVER,
            attributes={
                **self.attributes,
                "dask.peer.address": peer,
                **rpc.peer_attributes(peer, "network.peer"),
                "dask.transfer.keys": len(keys),
                "dask.transfer.bytes": nbytes,
            },
        )


class ExecuteTracer(_InstancePatch):
    """Replaces one worker's ``execute`` with a traced version of it."""

    name = "execute"

    def __init__(
        self, worker: Worker, tracer: trace.Tracer, task_duration: Any, settings: Settings
    ) -> None:
        super().__init__(worker)
        self.tracer = tracer
        self.task_duration = task_duration
        self.settings = settings
        #: Attributes of every span; ``dask.cluster.id`` joins once the scheduler answers.
        self.static_attributes = {
            "dask.worker.address": worker.address,
            "dask.worker.name": ids.cap(str(worker.name), settings.max_attribute_length),
        }

    async def execute(self, key: Any, *, stimulus_id: str) -> Any:
        ts = self.worker.state.tasks.get(key)
        annotation = ts.annotations.get(ids.ANNOTATION) if ts and ts.annotations else None
        carrier = ids.decode(annotation)
        # A key without "-" is its own prefix: capped like every other string.
        prefix = ids.cap(ts.prefix, self.settings.max_attribute_length) if ts else ""
        if carrier is None or not carrier.trace_flags.sampled:
            result = await self.original(key, stimulus_id=stimulus_id)
        else:
            result = await self._execute_traced(key, prefix, carrier, stimulus_id)
        if ts is not None and isinstance(result, (ExecuteSuccessEvent, ExecuteFailureEvent)):
            self._record_duration(prefix, result)
            if ids.thinned(annotation) and self._keep_anyway(result):
                self._emit_late(key, prefix, carrier, result)  # type: ignore[arg-type]
        return result

    def _keep_anyway(self, result: Any) -> bool:
        """A thinned task's attempt that failed or was slow is reported all the same."""
        if isinstance(result, ExecuteFailureEvent):
            return True
        return (result.stop - result.start) > self.settings.keep_slower_than

    def _emit_late(self, key: Any, prefix: str, carrier: trace.SpanContext, result: Any) -> None:
        """The execute span of a thinned task, after the fact (nothing nests under it)."""
        try:
            span = self._start(
                key, prefix, ids.with_sampled(carrier, True), int(result.start * 1e9)
            )
            self._finish(span, key, result, int(result.stop * 1e9))
        except Exception:
            _tracing_failed()

    async def _execute_traced(
        self, key: Any, prefix: str, carrier: trace.SpanContext, stimulus_id: str
    ) -> Any:
        try:
            span = self._start(key, prefix, carrier)
            token = context.attach(trace.set_span_in_context(span))
        except Exception:
            # Telemetry must never keep a task from running (a failing user
            # SpanProcessor, say): run it untraced.
            _tracing_failed()
            return await self.original(key, stimulus_id=stimulus_id)
        try:
            result = await self.original(key, stimulus_id=stimulus_id)
        except BaseException as e:
            # Dask's execute handles task errors itself: this is Dask failing (or cancelled).
            stack = "".join(traceback.format_tb(e.__traceback__))
            errors.record_exception(span, e, None, stack, self.settings.max_attribute_length)
            span.end()
            raise
        finally:
            context.detach(token)
        try:
            self._finish(span, key, result)
        except Exception:
            _tracing_failed()
        return result

    def _start(
        self, key: Any, prefix: str, carrier: trace.SpanContext, start_time: int | None = None
    ) -> trace.Span:
        key_str = ids.key_to_str(key)
        limit = self.settings.max_attribute_length
        return self.tracer.start_span(
            f"execute {prefix}",
            context=ids.task_context(carrier, key_str),
            start_time=start_time,
            attributes={
                **self.static_attributes,
                "dask.task.key": ids.cap(key_str, limit),
                "dask.task.prefix": prefix,
                "dask.task.group": ids.cap(key_split_group(key), limit),
            },
        )

    def _record_duration(self, prefix: str, result: Any) -> None:
        """One ``dask.task.duration`` point per attempt, traced or not (Dask's timings)."""
        if result.start is None or result.stop is None:
            return
        outcome = "success" if isinstance(result, ExecuteSuccessEvent) else "error"
        try:
            self.task_duration.record(
                max(0.0, result.stop - result.start),
                {
                    **self.static_attributes,
                    "dask.task.prefix": prefix,
                    "dask.task.outcome": outcome,
                },
            )
        except Exception:
            _tracing_failed()

    async def fetch_cluster_id(self) -> None:
        """Learn the scheduler's id, off the worker's start-up path."""
        try:
            identity = await asyncio.wait_for(
                self.worker.scheduler.identity(n_workers=0), IDENTITY_TIMEOUT
            )
        except Exception as e:
            logger.warning("dask-otel: cannot read the scheduler's id, spans lack it: %r", e)
            return
        self.static_attributes["dask.cluster.id"] = identity["id"]
        logs.identity["dask.cluster.id"] = identity["id"]

    def _finish(self, span: trace.Span, key: Any, result: Any, end_time: int | None = None) -> None:
        thread = self.worker.threads.get(key)
        if thread is not None:
            span.set_attribute("thread.id", thread)
        if isinstance(result, RescheduleEvent):
            span.set_attribute("dask.task.rescheduled", True)
        elif isinstance(result, ExecuteFailureEvent):
            errors.record_exception(
                span,
                result.exception,
                result.exception_text,
                result.traceback_text,
                self.settings.max_attribute_length,
            )
        span.end(end_time)


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
        settings = activate("worker")
        if settings is None:
            return
        self._providers = telemetry.current()
        self._settings = settings
        meter_provider = self._meter_provider = metrics.meter_provider(self._providers, settings)
        sources = metrics.sources(meter_provider)
        self._tracer = ExecuteTracer(
            worker, self._providers.tracer(), sources.task_duration, settings
        )
        attributes = self._tracer.static_attributes
        self._patches = [
            self._tracer,
            TransferTracer(worker, self._tracer.tracer, sources, attributes, settings),
        ]
        tracer = self._tracer.tracer
        limit = settings.max_attribute_length
        if settings.transfer_spans:
            self._patches.append(GetDataTracer(worker, tracer, attributes, limit))
        if settings.spill_spans and SpillTracer.applies(worker):
            self._patches.append(SpillTracer(worker, tracer, attributes, limit))
        for patch in self._patches:
            patch.install()
        self._handlers = rpc.trace_handlers(worker, tracer, settings)
        metrics.observe_worker(meter_provider, worker, self._tracer.static_attributes)
        logs.add_worker(worker.address)
        self._identity = asyncio.create_task(self._tracer.fetch_cluster_id())

    async def teardown(self, worker: Worker) -> None:
        if self._tracer is None:
            return
        for patch in self._patches:
            patch.uninstall()
        worker.handlers.update(self._handlers)
        self._tracer = None
        self._identity.cancel()
        # The last collection still reads this worker: flush first, then let it go.
        await asyncio.get_running_loop().run_in_executor(
            None, telemetry.flush, self._providers, self._settings.flush_timeout
        )
        metrics.forget(self._meter_provider, worker)
        logs.remove_worker(worker.address)
