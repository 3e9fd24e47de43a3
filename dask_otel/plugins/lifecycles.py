"""``otel.scheduler.task-spans: all`` (trace model v1): every traced task's lifecycle,
recorded on the scheduler, and its ``task`` span at its final state (workers then emit
``execute`` spans under them): ~100 us of scheduler CPU per task."""

from __future__ import annotations

from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from dask_otel.plugins.scheduler_spans import FINAL_STATES, Graph, TaskRecord, TaskSpans, failure

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import Settings
    from dask_otel.plugins.carriers import Carriers
    from dask_otel.spans.emitter import SpanEmitter

#: States a task enters on submission, shown by its span's start rather than by events.
BEFORE_RUN = frozenset({"waiting", "queued"})


class Lifecycles:
    """The lifecycle of each traced task of one scheduler, from its graph to its final
    state; :meth:`clear` stops recording."""

    def __init__(
        self,
        scheduler: Scheduler,
        settings: Settings,
        carriers: Carriers,
        spans: TaskSpans,
        emitter: SpanEmitter,
    ) -> None:
        self._scheduler = scheduler
        self._settings = settings
        self._carriers = carriers
        self._spans = spans
        self._emitter = emitter
        #: Each traced task's record, by key, until its final state.
        self._records: dict[Any, TaskRecord] = {}

    def add(self, ts: Any, graph: Graph, now: int, kept: bool) -> None:
        """Record the lifecycle of ``ts``, created by ``graph`` (a span of its own if
        ``kept``, else only when it fails or is slow)."""
        self._records[ts.key] = TaskRecord(ts.key, ts.prefix.name, ts.group.name, graph, now, kept)

    def clear(self) -> None:
        self._records = {}

    def transition(
        self, key: Any, start: str, finish: str, stimulus_id: str | None, kwargs: dict[str, Any]
    ) -> TaskRecord | None:
        """Note a transition of ``key``; the record it finished (its span submitted), if
        ``finish`` is a final state."""
        record = self._records.get(key)
        if record is None:
            return None
        if finish == "processing":
            ws = self._scheduler.tasks[key].processing_on
            worker = ws.address if ws is not None else None
            record.add_attempt(worker)
        else:
            worker = kwargs.get("worker")
        if finish in FINAL_STATES:
            self._finish(record, finish, time_ns(), kwargs)
            return record
        # Events: the states entered between the span's start and end (the final state),
        # but for waiting and queued before the first attempt: the span's start is the
        # submission, and the time to the first ``processing`` is spent in those. Thinned
        # tasks record none.
        if record.kept:
            if start != finish and (record.attempts or finish not in BEFORE_RUN):
                event = (finish, time_ns(), stimulus_id, worker)
                record.add_event(event, self._settings.max_task_events)
        elif start == "processing" and stimulus_id and stimulus_id.startswith("task-erred"):
            record.erred_attempt = True  # retried (to waiting), or released by a restart
        return None

    def _finish(self, record: TaskRecord, state: str, now: int, kwargs: dict[str, Any]) -> None:
        del self._records[record.key]
        record.state = state
        record.end_ns = now
        for startstop in kwargs.get("startstops") or ():
            if startstop.get("action") == "compute":
                record.compute_seconds += startstop["stop"] - startstop["start"]
        ts = self._scheduler.tasks.get(record.key)
        if state == "erred":
            record.error = failure(ts, kwargs)
        # Thinned tasks still get a span when an attempt failed (retried or not) or was
        # slow: the worker, which sees the same failure and compute time, emits its
        # execute span too, whose parent this span is.
        failed = record.erred_attempt or (
            state == "erred" and record.error["cause"] in (None, record.key)  # type: ignore[index]
        )
        settings = self._settings
        if record.kept or (
            settings.task_spans and (failed or record.compute_seconds > settings.keep_slower_than)
        ):
            if ts is not None:
                if state == "memory" and ts.nbytes >= 0:
                    record.nbytes = ts.nbytes
                record.dependencies = [
                    (dts.key, self._carriers.annotation(dts.key))
                    for dts in islice(ts.dependencies, settings.max_task_links)
                ]
            self._emitter.submit(self._spans.task, record, record.graph.carrier.context)
