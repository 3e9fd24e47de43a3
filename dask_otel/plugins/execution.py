"""Task execution on a worker: the span of each traced attempt (``task <prefix>`` for the
one that produced the result, ``attempt <prefix>`` otherwise) and a
``dask.task.duration`` point per attempt."""

from __future__ import annotations

from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from distributed.utils import key_split_group
from distributed.worker import WORKER_ANY_RUNNING
from distributed.worker_state_machine import (
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    RescheduleEvent,
)
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind

from dask_otel import strings
from dask_otel.plugins.worker_patch import InstancePatch
from dask_otel.postmortem import flight_recorder
from dask_otel.spans import errors, ids
from dask_otel.spans.records import DeferredSpan, TaskAttemptSpan

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Worker

    from dask_otel.config import Settings
    from dask_otel.spans.records import EndedSpans


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
        #: The worker's state of the task at the end (``cancelled``: released meanwhile,
        #: or the worker no longer running).
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


class ExecuteTracer(InstancePatch):
    """Replaces one worker's ``execute``: the span of each traced attempt and a
    ``dask.task.duration`` point per attempt.

    On the event loop, a traced attempt only makes a :class:`DeferredSpan` current (user
    spans, logs and ``rpc`` spans in the task see it) and notes the outcome; the span and
    the metric point are made by the worker's emitter thread: the ``task`` span if the
    attempt produced the result, an ``attempt`` span if it failed or was rescheduled
    (:mod:`dask_otel.spans.ids`).
    """

    name = "execute"

    def __init__(
        self,
        worker: Worker,
        spans: EndedSpans,
        attributes: dict[str, Any],
        task_duration: Any,
        settings: Settings,
        carriers: ids.TaskCarriers,
    ) -> None:
        super().__init__(worker)
        self.carriers = carriers
        #: Builds this worker's spans (its emitter: that of the worker's other spans too).
        self.spans = spans
        self.task_duration = task_duration
        self.settings = settings
        #: Attributes of every span of this worker.
        self.static_attributes = attributes
        #: Where the attempts in progress are noted for this worker's Nanny, if any.
        self.recorder = flight_recorder.open_for(worker, settings.flight_recorder_size)
        if self.recorder is not None:
            from dask_otel.export import recorder_copy  # imports the SDK: not at import time

            recorder_copy.mirror(self.recorder)  # this process's export queues, copied to it

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
                if carrier.from_client
                else TaskAttemptSpan(carrier, key)
            )
            token = context.attach(trace.set_span_in_context(span))
        attempt = _Attempt(key, ts.prefix, annotation, span, carriers.taken_up(ts, time_ns()))
        recorder = self.recorder
        if recorder is not None:  # for the Nanny, should this process die during the attempt
            slot = recorder.started(
                strings.key_to_str(key),
                ts.prefix,
                annotation if carrier is not None else None,
                ts.run_id,
                attempt.start_ns,
            )
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
            if span is not None:
                span.ended(attempt.end_ns)
            attempt.thread = self.worker.threads.get(key)
            # A worker the scheduler removed meanwhile (closing or closed) reports no
            # span: the scheduler's ``attempt`` or ``task`` span stands for the attempt.
            attempt.state = ts.state if self.worker.status in WORKER_ANY_RUNNING else "cancelled"
            if carrier is not None:
                attempt.annotation = carriers.get(ts)
                if attempt.outcome == "success":
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
        prefix = strings.cap(attempt.prefix, self.settings.max_attribute_length)
        timing = attempt.timing
        if timing is not None:
            self._record_duration(prefix, attempt.outcome, timing)  # type: ignore[arg-type]
        carrier = ids.parse(attempt.annotation)
        if carrier is None:
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
            self._emit(attempt, name, carrier, None, None)
        elif attempt.outcome == "success":
            self._emit(attempt, name, carrier, self._links(attempt, carrier), carrier.span_id)
        else:  # failed or rescheduled: beside the task's span, which links to it
            self._emit(attempt, name, carrier, None, carrier.span_id)

    def _keep_anyway(self, attempt: _Attempt) -> bool:
        """A thinned task's attempt is reported if it failed or was slow."""
        start, stop = attempt.timing  # type: ignore[misc]
        return attempt.outcome == "error" or stop - start > self.settings.keep_slower_than

    def _emit(
        self,
        attempt: _Attempt,
        name: str,
        carrier: ids.Carrier,
        links: list[trace.Link] | None,
        span_id: Callable[[str], int] | None,
    ) -> None:
        """The attempt's span, named ``name``, under the carrier's span: its id the one
        ``span_id`` names (None: the current span's, or a new one)."""
        key = strings.key_to_str(attempt.key)
        limit = self.settings.max_attribute_length
        parent = ids.with_sampled(carrier.context, True)  # a thinned task kept anyway
        if attempt.span is not None:
            start, end = attempt.start_ns, attempt.end_ns
        else:  # timed by Dask (nothing nested under it: it was not current)
            start, end = (int(t * 1e9) for t in attempt.timing)  # type: ignore[union-attr]
        final: dict[str, Any] = {}
        if attempt.thread is not None:
            final["thread.id"] = attempt.thread
        if attempt.outcome == "rescheduled":
            final["dask.task.rescheduled"] = True
        if attempt.nbytes is not None:
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
                "dask.task.key": strings.cap(key, limit),
                "dask.task.prefix": strings.cap(attempt.prefix, limit),
                # A tuple key's group is its first element, of any key type.
                "dask.task.group": strings.cap(
                    strings.key_to_str(key_split_group(attempt.key)), limit
                ),
            },
            attempt.failure,
            links=links,
            deferred=attempt.span,
            final=final,
            span_id=span_id(key) if span_id is not None else None,
        )

    @staticmethod
    def _links(attempt: _Attempt, carrier: ids.Carrier) -> list[trace.Link]:
        """Links to the spans of the task's earlier attempts, then of its dependencies: as
        the scheduler named them, or derived from their keys (same graph; in a thinned
        graph only those known here)."""
        relation = {"dask.link": "dependency"}
        generation = carrier.generation
        links = (
            ids.earlier_attempt_links(carrier.context, strings.key_to_str(attempt.key), generation)
            if generation
            else []
        )
        if carrier.links is not None:
            return links + [trace.Link(link, relation) for link in carrier.links]
        for key, annotation in attempt.dependencies:
            ref = ids.task_ref(annotation, key)
            if ref is None and not carrier.partial:
                ref = ids.TaskRef(carrier._replace(generation=0), strings.key_to_str(key))
            if ref is not None:
                links.append(trace.Link(ref.span_context, relation))
        return links

    def _record_duration(self, prefix: str, outcome: str, timing: tuple[float, float]) -> None:
        """One ``dask.task.duration`` point per attempt, traced or not (Dask's timings)."""
        self.task_duration.record(
            max(0.0, timing[1] - timing[0]),
            {**self.static_attributes, "dask.task.prefix": prefix, "dask.task.outcome": outcome},
        )
