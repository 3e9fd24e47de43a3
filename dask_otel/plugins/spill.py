"""``spill <prefix>`` and ``unspill <prefix>``: a worker moving a task's data to and from disk.

Dask's ``SpillBuffer`` keeps its disk layer (``Slow``) behind a ``zict.Cache``; dask-otel
puts :class:`TracedDisk` in front of it, so a span covers exactly the pickling and the
file write (or the read and unpickling) of one key, with the sizes Dask measured. Data
is spilled and read back after the task that produced it ended: the span roots a trace
of its own, linked to that task's span (``dask.link`` ``result``). Why a key was spilled
comes from who asked: the memory monitor (process memory above the spill threshold), a
call to ``evict()`` (explicit), or else the buffer itself (managed memory above the
target threshold).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from time import time_ns
from typing import TYPE_CHECKING, Any

from distributed.spill import PickleError, SpillBuffer
from opentelemetry import trace

from dask_otel import strings
from dask_otel.runtime import report_once
from dask_otel.spans import ids
from dask_otel.spans.records import EndedSpans

if TYPE_CHECKING:
    from distributed import Worker


logger = logging.getLogger(__name__)

#: Why keys are being spilled in the current task: ``target`` unless set.
_reason: ContextVar[str] = ContextVar("dask_otel_spill_reason", default="target")


class TracedDisk(MutableMapping):
    """The spill buffer's disk mapping, with a span per key written or read.

    Spills and unspills run on the event loop and nothing nests under their spans: the
    loop notes the times and sizes, the worker's emitter builds the spans.
    """

    def __init__(
        self,
        disk: Any,
        worker: Worker,
        spans: EndedSpans,
        attributes: dict,
        limit: int,
        carriers: ids.TaskCarriers,
    ) -> None:
        self.disk = disk
        self.worker = worker
        self.spans = spans
        self.attributes = attributes
        self.limit = limit
        self.carriers = carriers

    def __getattr__(self, name: str) -> Any:
        # ``total_weight``, ``weight_by_key``, ``max_weight``... read by SpillBuffer
        return getattr(self.disk, name)

    def __len__(self) -> int:
        return len(self.disk)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.disk)

    def __contains__(self, key: object) -> bool:
        return key in self.disk

    def __delitem__(self, key: Any) -> None:
        del self.disk[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        started = self._start("spill", key, {"dask.spill.reason": _reason.get()})
        if started is None:
            self.disk[key] = value
            return
        with _SpillScope(self, key, *started):
            self.disk[key] = value

    def __getitem__(self, key: Any) -> Any:
        started = self._start("unspill", key, {})
        if started is None:
            return self.disk[key]
        with _SpillScope(self, key, *started):
            return self.disk[key]

    def _start(
        self, operation: str, key: Any, attributes: dict
    ) -> tuple[str, ids.TaskRef, dict[str, Any]] | None:
        """(span name, the task that produced ``key``, attributes) if that task is traced."""
        try:
            ts = self.worker.state.tasks.get(key)
            traced = self.carriers.traced(ts) if ts is not None else None
            if traced is None:
                return None
            prefix = strings.cap(ts.prefix, self.limit)  # type: ignore[union-attr]
            return (
                f"{operation} {prefix}",
                traced,
                {
                    **self.attributes,
                    **attributes,
                    "dask.task.key": strings.cap(traced.key, self.limit),
                    "dask.task.prefix": prefix,
                },
            )
        except Exception:
            _tracing_failed()
            return None

    def sizes(self, key: Any, attributes: dict[str, Any]) -> None:
        """Bytes in memory (Dask's ``sizeof``) and on disk, as Dask measured them."""
        try:
            weight = self.disk.weight_by_key.get(key)
            if weight is not None:
                attributes["dask.spill.bytes"] = weight.memory
                attributes["dask.spill.disk_bytes"] = weight.disk
        except Exception:
            _tracing_failed()


class _SpillScope:
    """Times one spill or unspill and hands its span to the emitter; a failure
    (unpicklable data, disk full, max-spill) makes it an ERROR span."""

    def __init__(
        self,
        disk: TracedDisk,
        key: Any,
        name: str,
        task: ids.TaskRef,
        attributes: dict[str, Any],
    ) -> None:
        self.disk = disk
        self.key = key
        self.name = name
        #: The task whose result is moved: the span links to its span.
        self.task = task
        self.attributes = attributes

    def __enter__(self) -> None:
        self.start = time_ns()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        times = (self.start, time_ns())
        self.disk.sizes(self.key, self.attributes)
        # Dask wraps a pickling failure; the cause says what could not be pickled.
        cause = exc.__cause__ if isinstance(exc, PickleError) else None
        self.disk.spans.submit(
            self.name,
            trace.INVALID_SPAN_CONTEXT,  # after the task's span: a trace of its own
            trace.SpanKind.INTERNAL,
            times,
            self.attributes,
            cause or exc,
            [ids.task_link(self.task, "result")],
        )


def _tracing_failed() -> None:
    report_once(logger, "spill", "dask-otel: spill tracing failed (said once)")


class SpillTracer:
    """Puts :class:`TracedDisk` into one worker's spill buffer and labels why it spills."""

    def __init__(
        self,
        worker: Worker,
        spans: EndedSpans,
        attributes: dict,
        limit: int,
        carriers: ids.TaskCarriers,
    ):
        self.worker = worker
        self.buffer = worker.data
        self.cache = self.buffer.slow
        self.disk = TracedDisk(self.cache.data, worker, spans, attributes, limit, carriers)
        self.manager = worker.memory_manager
        self.original_evict = self.buffer.evict
        self.original_maybe_spill = self.manager._maybe_spill

    @staticmethod
    def applies(worker: Worker) -> bool:
        """Whether the worker spills through Dask's own ``SpillBuffer``."""
        return isinstance(worker.data, SpillBuffer) and hasattr(worker.data.slow, "data")

    def install(self) -> None:
        self.cache.data = self.disk
        self.buffer.evict = self.evict
        self.manager._maybe_spill = self.maybe_spill

    def uninstall(self) -> None:
        if self.cache.data is self.disk:
            self.cache.data = self.disk.disk
        for owner, name, ours in (
            (self.buffer, "evict", self.evict),
            (self.manager, "_maybe_spill", self.maybe_spill),
        ):
            if owner.__dict__.get(name) == ours:
                delattr(owner, name)

    def evict(self) -> int:
        """``SpillBuffer.evict``: spilling asked for explicitly (or by the monitor)."""
        token = _reason.set("explicit") if _reason.get() == "target" else None
        try:
            return self.original_evict()
        finally:
            if token is not None:
                _reason.reset(token)

    async def maybe_spill(self, worker: Worker, memory: int) -> None:
        """The memory monitor's spilling (its task copies this context)."""
        token = _reason.set("memory-monitor")
        try:
            await self.original_maybe_spill(worker, memory)
        finally:
            _reason.reset(token)
