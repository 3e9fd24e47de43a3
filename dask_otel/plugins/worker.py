"""Worker plugin: the span of each task attempt (``task <prefix>`` for the one that
produced the result, ``attempt <prefix>`` otherwise; :mod:`~dask_otel.plugins.execution`),
``transfer`` (:mod:`~dask_otel.plugins.transfers`), ``spill`` and ``unspill``.

Every span names its parent by a deterministic id (:mod:`dask_otel.spans.ids`), so no
message is added and nobody waits: an attempt's span is its task's in its generation,
parented to the graph span (an attempt without a result too, beside the span of the
one that produced it, which links to it); a fetch (``transfer``) is under the task
whose inputs it fetched, which begins at its first fetch. The attempt's span is current
while the task runs: ``Worker.execute`` hands contextvars to the executor thread, so
user spans nest under it and user log records carry its ids.

A task's carrier arrives in its ``compute-task`` message's annotations and is taken out
before the worker reads them (:class:`CarrierReceiver`): the task's annotations stay the
user's, its carrier is kept beside it (:class:`dask_otel.spans.ids.TaskCarriers`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from distributed import core
from distributed.diagnostics.plugin import WorkerPlugin

from dask_otel import identity, runtime, strings
from dask_otel.export import metric_series
from dask_otel.plugins import carried, client, rpc
from dask_otel.plugins.activation import activate
from dask_otel.plugins.execution import ExecuteTracer
from dask_otel.plugins.spill import SpillTracer
from dask_otel.plugins.transfers import TransferTracer
from dask_otel.runtime import PLUGIN_NAME
from dask_otel.signals import metrics
from dask_otel.spans import ids
from dask_otel.spans.emitter import drain, off_loop
from dask_otel.spans.records import ended_spans

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Worker

logger = logging.getLogger(__name__)

#: How long a worker keeps asking for the scheduler's id (``dask.cluster.id``).
IDENTITY_TIMEOUT = 60.0


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


class DaskOtelWorkerPlugin(WorkerPlugin):
    """Traces task execution on every worker it reaches (pickled to remote workers)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, asked: dict[str, Any] | None = None) -> None:
        #: The client's settings it carries (:mod:`dask_otel.plugins.carried`).
        self._asked = asked or {}
        #: Set up to teardown, while dask-otel traces this worker.
        self._execute: ExecuteTracer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"asked": self._asked}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("asked"))  # type: ignore[misc]

    async def setup(self, worker: Worker) -> None:
        carried.apply_asked(self._asked)
        settings = activate("worker", worker)
        if settings is None:
            return
        self._providers = runtime.current()
        self._settings = settings
        meter_provider = self._meter_provider = metrics.meter_provider(self._providers, settings)
        sources = metrics.sources(meter_provider)
        carriers = ids.TaskCarriers()
        tracer = self._providers.tracer()
        limit = settings.max_attribute_length
        # Attributes of every span; ``dask.cluster.id`` joins once the scheduler answers.
        attributes = {
            "dask.worker.address": worker.address,
            "dask.worker.name": strings.cap(str(worker.name), limit),
        }
        # Builds this worker's spans (``execute`` and the ended spans of its other work).
        ended = ended_spans(tracer, settings.max_attribute_length)
        self._execute = ExecuteTracer(
            worker, ended, attributes, sources.task_duration, settings, carriers
        )
        self._patches = [
            CarrierReceiver(worker, carriers),
            self._execute,
            TransferTracer(worker, ended, sources, attributes, settings, carriers),
        ]
        if settings.spill_spans and SpillTracer.applies(worker):
            self._patches.append(SpillTracer(worker, ended, attributes, limit, carriers))
        for patch in self._patches:
            patch.install()
        self._handlers = rpc.trace_handlers(worker, tracer, settings)
        # Tasks that submit tasks (``worker_client``) trace the submission in their own
        # trace, whichever way dask-otel came into this process.
        client.trace_submissions(client.IN_TASKS)
        metrics.observe_worker(meter_provider, worker, attributes)
        identity.hosted.add_worker(worker.address)
        self._identity = asyncio.create_task(_fetch_cluster_id(worker, attributes))

    def flush(self, timeout: float) -> bool:
        """Wait until every span this plugin recorded so far was emitted (tests and
        benchmarks); False on timeout."""
        return self._execute is None or self._execute.spans.emitter.flush(timeout)

    async def teardown(self, worker: Worker) -> None:
        if self._execute is None:
            return
        # The reverse of setup: the rpc wrappers went around the patched handlers.
        client.untrace_submissions(client.IN_TASKS)
        worker.handlers.update(self._handlers)
        for patch in self._patches:
            patch.uninstall()
        closing = self._execute.spans.emitter
        attributes = self._execute.static_attributes
        if self._execute.recorder is not None:
            from dask_otel.export import recorder_copy

            recorder_copy.mirror(None)
            self._execute.recorder.close()  # closed normally: its recorder is deleted
        self._execute = None
        self._identity.cancel()
        budget = self._settings.flush_timeout
        if worker.nanny is not None:  # which kills its worker if it takes 4 s to close
            budget = runtime.closing_under_nanny(budget)
        # The last collection still reads this worker: flush first, then let it go.
        await off_loop(drain, closing, self._providers, budget)
        metrics.forget(self._meter_provider, worker)
        metric_series.let_go(self._meter_provider, {"dask.worker.address": worker.address})
        identity.hosted.remove_worker(worker.address)
        if "dask.cluster.id" in attributes:  # the scheduler answered: named above
            identity.hosted.remove_cluster(attributes["dask.cluster.id"])


async def _fetch_cluster_id(worker: Worker, attributes: dict[str, Any]) -> None:
    """Learn the scheduler's id, off the worker's start-up path, on a connection of
    its own that closes after: left in the worker's pool, it would be the one the
    worker's first heartbeat opens plain, and that heartbeat would change."""
    try:
        async with core.rpc(
            worker.scheduler.address, connection_args=worker.connection_args
        ) as scheduler:
            scheduler_identity = await asyncio.wait_for(
                scheduler.identity(n_workers=0), IDENTITY_TIMEOUT
            )
    except Exception as e:
        logger.warning("dask-otel: cannot read the scheduler's id, spans lack it: %r", e)
        return
    attributes["dask.cluster.id"] = scheduler_identity["id"]
    identity.hosted.add_cluster(scheduler_identity["id"])
