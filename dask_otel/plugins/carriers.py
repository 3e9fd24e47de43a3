"""Each traced task's carrier (:class:`dask_otel.spans.ids.Carrier`), kept on the
scheduler by key, never in the task's annotations, which are the user's.

The client's context is taken out of the ``update-graph`` message before Dask reads its
annotations, and a task's carrier is added to a copy of its annotations in the
``compute-task`` message only (the worker plugin takes it out again). Per task that is
one dict entry and one dict copy per dispatch.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from dask_otel.spans import ids

if TYPE_CHECKING:
    from distributed import Scheduler

#: The carrier the client sent with the ``update-graph`` message being handled (Dask
#: handles a client's messages one after another, each client in a task of its own).
_submitted: ContextVar[str | None] = ContextVar("dask_otel_submitted", default=None)


def submitted() -> ids.Carrier | None:
    """The client's carrier of the graph whose ``update_graph`` is running."""
    return ids.parse(_submitted.get())


class Carriers:
    """The carrier of each task traced on one scheduler, until the task is forgotten;
    from creation to :meth:`close`, that scheduler's messages pass through it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        #: The carrier (``otel`` annotation text) of each task traced here, by key.
        self._annotations: dict[Any, str] = {}
        #: Dask's own ``update-graph`` handler and ``compute-task`` message builder.
        self._receive_graph = scheduler.stream_handlers["update-graph"]
        self._task_message = scheduler._task_to_msg
        scheduler.stream_handlers["update-graph"] = self._update_graph_message
        scheduler._task_to_msg = self._task_to_msg  # type: ignore[method-assign]

    def __len__(self) -> int:
        return len(self._annotations)

    def of(self, ts: Any) -> ids.Carrier | None:
        """The carrier of a scheduler ``TaskState``, if dask-otel traces it."""
        return None if ts is None else ids.parse(self._annotations.get(ts.key))

    def annotation(self, key: Any) -> str | None:
        """The carrier of ``key`` as its ``otel`` annotation text, if traced."""
        return self._annotations.get(key)

    def set(self, key: Any, annotation: str) -> None:
        self._annotations[key] = annotation

    def forget(self, key: Any) -> None:
        self._annotations.pop(key, None)

    def next_generation(self, ts: Any, traced: bool = False) -> None:
        """Move ``ts`` to its next generation of span ids (traced from now on if
        ``traced`` and it was thinned out of a traced graph; a task of a graph with no
        per-task spans, ``otel.spans.tasks: false`` or not sampled, stays untraced)."""
        carrier = self.of(ts)
        if carrier is None:
            return
        carrier = carrier._replace(generation=carrier.generation + 1)
        if traced and carrier.thinned and not carrier.context.trace_flags.sampled:
            carrier = carrier._replace(
                context=ids.with_sampled(carrier.context, True), thinned=False
            )
        self._annotations[ts.key] = carrier.encode()

    def close(self) -> None:
        """Forget every carrier and give the scheduler its own handlers back."""
        self._annotations = {}
        scheduler = self._scheduler
        if scheduler.stream_handlers.get("update-graph") == self._update_graph_message:
            scheduler.stream_handlers["update-graph"] = self._receive_graph
        if scheduler.__dict__.get("_task_to_msg") == self._task_to_msg:
            del scheduler._task_to_msg

    async def _update_graph_message(self, *, annotations: Any = None, **kwargs: Any) -> None:
        """Dask's ``update-graph`` handler, given the message's global annotations without
        the client's carrier, which :func:`submitted` returns meanwhile."""
        annotations, carrier = ids.take_carrier(annotations)
        token = _submitted.set(carrier)
        try:
            await self._receive_graph(annotations=annotations, **kwargs)
        finally:
            _submitted.reset(token)

    def _task_to_msg(self, ts: Any) -> dict[str, Any]:
        """Dask's ``compute-task`` message, with the task's carrier in a copy of its
        annotations (a worker without dask-otel keeps it there, as before)."""
        msg = self._task_message(ts)
        carrier = self._annotations.get(ts.key)
        if carrier is not None:
            annotations = msg["annotations"]
            msg["annotations"] = (
                {**annotations, ids.ANNOTATION: carrier}
                if annotations
                else {ids.ANNOTATION: carrier}
            )
        return msg
