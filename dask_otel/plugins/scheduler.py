"""Scheduler plugin: a ``graph`` span per ``update_graph``; task spans for anomalies only.

The worker that produces a task's result emits its ``task`` span, with
the deterministic id of :mod:`dask_otel.spans.ids`. The scheduler does no span work for a task
that completes normally: its hot path (``transition``, ~7 calls per task) only notes
when a graph's last task is done (:mod:`~dask_otel.plugins.graphs`), and acts on the few
transitions that mean something went wrong (:mod:`~dask_otel.plugins.anomalies`). Each
task's carrier is kept beside its annotations (:mod:`~dask_otel.plugins.carriers`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_otel import identity, runtime
from dask_otel.export import metric_series
from dask_otel.plugins import carried, rpc
from dask_otel.plugins.activation import activate
from dask_otel.plugins.anomalies import Anomalies
from dask_otel.plugins.carriers import Carriers
from dask_otel.plugins.graphs import Graphs
from dask_otel.plugins.scheduler_spans import FINAL_STATES, TaskSpans
from dask_otel.runtime import PLUGIN_NAME
from dask_otel.signals import events, metrics
from dask_otel.spans import emitter, ids
from dask_otel.spans.emitter import drain, off_loop

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import Settings

#: States a task leaves for ``released`` without a result (``erred`` was reported).
WITHOUT_RESULT = frozenset({"processing", "waiting", "queued", "no-worker"})


class _Tracing:
    """What traces one scheduler, from the plugin's ``start`` to its ``close``."""

    def __init__(self, scheduler: Scheduler, settings: Settings) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.providers = runtime.current()
        tracer = self.providers.tracer()
        self.cluster_id: str = scheduler.id
        #: The process's emitter (the spans of in-process workers go through it too).
        self.emitter = emitter.shared()
        self.meter_provider = metrics.meter_provider(self.providers, settings)
        metrics.observe_scheduler(self.meter_provider, scheduler)
        self.events = events.EventRecorder(
            self.providers.logger_provider,
            self.cluster_id,
            settings.max_attribute_length,
            settings.logs_exclude_event_topics,
        )
        identity.hosted.add_cluster(self.cluster_id)
        #: The scheduler's rpc handlers as they were before tracing wrapped them.
        self.handlers = rpc.trace_handlers(scheduler, tracer, settings)
        self.carriers = Carriers(scheduler)
        spans = TaskSpans(ids.SpanIdSetter(tracer), self.cluster_id, settings.max_attribute_length)
        self.graphs = Graphs(settings, tracer, self.cluster_id, self.carriers, self.emitter)
        self.anomalies = Anomalies(scheduler, self.carriers, self.graphs, spans, self.emitter)

    def transition(
        self,
        key: Any,
        start: str,
        finish: str,
        *args: Any,
        stimulus_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        """The plugin's ``transition`` while it runs (Dask calls it directly: ~6 calls per
        task, one Python frame each)."""
        if finish == "forgotten":
            self.carriers.forget(key)
        anomalies = self.anomalies
        if finish in FINAL_STATES:
            graph = self.graphs.pop_task(key)
            if finish == "erred":
                anomalies.erred(key, start, graph, kwargs)
            else:
                anomalies.ended(key)
            if graph is not None:
                self.graphs.count(graph, finish)
        elif finish == "released":
            # Never on a normal task's path: memory -> forgotten once nobody wants it.
            if start == "memory":
                anomalies.result_released(key)
            elif start in WITHOUT_RESULT:
                anomalies.left_without_result(key, start, stimulus_id)
        elif finish == "queued":
            self.graphs.queued(key)
        elif finish == "waiting":
            anomalies.waiting(key)

    def log_event(self, topic: str, msg: Any) -> bool:
        """Note a structured event; True if it is the first of a batch to export."""
        if isinstance(msg, dict):
            if topic == "all" and msg.get("action") == "remove-worker":
                self.anomalies.remove_worker(msg)
            elif topic == "worker-restart-memory":
                self.anomalies.memory_kill(msg)
        return self.events.add(topic, msg)

    def flush_events(self) -> None:
        for event in self.events.take():
            self.emitter.submit(self.events.emit, *event)

    async def close(self) -> None:
        # Stop recording: transitions from now on find no graph.
        self.carriers.close()
        self.graphs.close()
        self.scheduler.handlers.update(self.handlers)
        await off_loop(drain, self.emitter, self.providers, self.settings.flush_timeout)
        # After the final flush, whose collection still reads this scheduler.
        metrics.forget(self.meter_provider, self.scheduler)
        metric_series.let_go(self.meter_provider, {"dask.cluster.id": self.cluster_id})
        identity.hosted.remove_cluster(self.cluster_id)


class DaskOtelSchedulerPlugin(SchedulerPlugin):
    """Traces every graph, and the tasks no worker finished, on its scheduler."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, asked: dict[str, Any] | None = None) -> None:
        #: The client's settings it carries (:mod:`dask_otel.plugins.carried`).
        self._asked = asked or {}
        #: The settings it started with; None before it starts or when it is off.
        self._settings: Settings | None = None
        #: None before ``start``, after ``close`` and when dask-otel is off.
        self._tracing: _Tracing | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"asked": self._asked}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("asked"))  # type: ignore[misc]

    async def start(self, scheduler: Scheduler) -> None:
        carried.apply_asked(self._asked)
        settings = activate("scheduler", scheduler)
        if settings is None:
            return
        self._settings = settings
        self._tracing = _Tracing(scheduler, settings)
        self.transition = self._tracing.transition  # type: ignore[method-assign]

    def update_graph(
        self,
        scheduler: Scheduler,
        *,
        client: str,
        keys: set[Any],
        tasks: list[Any],
        annotations: dict[str, dict[Any, Any]],
        **kwargs: Any,
    ) -> None:
        if self._tracing is not None:
            self._tracing.graphs.update_graph(scheduler, client, keys, tasks)

    def transition(
        self,
        key: Any,
        start: str,
        finish: str,
        *args: Any,
        stimulus_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Nothing to note before ``start`` and after ``close``; in between the running
        tracer's own method stands in for this one."""

    def log_event(self, topic: str, msg: Any) -> None:
        # Dask publishes one event under several topics (``all`` and a worker's address)
        # in one loop: gather them, export once from the background thread.
        if self._tracing is not None and self._tracing.log_event(topic, msg):
            asyncio.get_running_loop().call_soon(self._flush_events)

    def _flush_events(self) -> None:
        if self._tracing is not None:
            self._tracing.flush_events()

    # -- inspection (tests, benchmarks) ------------------------------------------------------

    @property
    def settings(self) -> Settings | None:
        """The settings this plugin runs with; None before it starts or when it is off."""
        return self._settings

    def flush(self, timeout: float) -> bool:
        """Wait until every span and event recorded so far was emitted (the emitter is
        the process's: the spans of in-process workers too); False on timeout."""
        return self._tracing is None or self._tracing.emitter.flush(timeout)

    def held(self) -> dict[str, int]:
        """What this plugin holds for work in progress: none once computations are over
        and their futures released."""
        tracing = self._tracing
        if tracing is None:
            return dict.fromkeys(("records", "carriers", "graphs", "events"), 0)
        return {
            "records": tracing.graphs.tasks,
            "carriers": len(tracing.carriers),
            "graphs": len(tracing.graphs),
            "events": len(tracing.events),
        }

    async def close(self) -> None:
        tracing, self._tracing = self._tracing, None
        self.__dict__.pop("transition", None)
        if tracing is not None:
            await tracing.close()
