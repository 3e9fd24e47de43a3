"""``spill <prefix>`` and ``unspill <prefix>``: a worker moving a task's data to and from disk.

Dask's ``SpillBuffer`` keeps its disk layer (``Slow``) behind a ``zict.Cache``; dask-otel
puts :class:`TracedDisk` in front of it, so a span covers exactly the pickling and the
file write (or the read and unpickling) of one key, with the sizes Dask measured. The
span joins the trace of the task that produced the data (its deterministic ``task``
span is the parent). Why a key was spilled comes from who asked: the memory monitor
(process memory above the spill threshold), a call to ``evict()`` (explicit), or else the
buffer itself (managed memory above the target threshold).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from distributed.spill import PickleError, SpillBuffer
from opentelemetry import trace

from dask_otel import errors, ids
from dask_otel.report import report_once

if TYPE_CHECKING:
    from distributed import Worker


logger = logging.getLogger(__name__)

#: Why keys are being spilled in the current task: ``target`` unless set.
_reason: ContextVar[str] = ContextVar("dask_otel_spill_reason", default="target")


class TracedDisk(MutableMapping):
    """The spill buffer's disk mapping, with a span per key written or read."""

    def __init__(
        self, disk: Any, worker: Worker, tracer: trace.Tracer, attributes: dict, limit: int
    ) -> None:
        self.disk = disk
        self.worker = worker
        self.tracer = tracer
        self.attributes = attributes
        self.limit = limit

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
        span = self._start("spill", key, {"dask.spill.reason": _reason.get()})
        if span is None:
            self.disk[key] = value
            return
        with _SpillScope(span, self.limit):
            self.disk[key] = value
            self._sizes(span, key)

    def __getitem__(self, key: Any) -> Any:
        span = self._start("unspill", key, {})
        if span is None:
            return self.disk[key]
        with _SpillScope(span, self.limit):
            self._sizes(span, key)
            return self.disk[key]

    def _start(self, operation: str, key: Any, attributes: dict) -> trace.Span | None:
        """A span if the task that produced ``key`` is traced, else None."""
        try:
            ts = self.worker.state.tasks.get(key)
            traced = ids.traced_task(ts.annotations, key) if ts is not None else None
            if traced is None:
                return None
            carrier, key_str = traced
            prefix = ids.cap(ts.prefix, self.limit)  # type: ignore[union-attr]
            return self.tracer.start_span(
                f"{operation} {prefix}",
                context=ids.task_context(carrier, key_str),
                attributes={
                    **self.attributes,
                    **attributes,
                    "dask.task.key": ids.cap(key_str, self.limit),
                    "dask.task.prefix": prefix,
                },
            )
        except Exception:
            _tracing_failed()
            return None

    def _sizes(self, span: trace.Span, key: Any) -> None:
        """Bytes in memory (Dask's ``sizeof``) and on disk, as Dask measured them."""
        try:
            weight = self.disk.weight_by_key.get(key)
            if weight is not None:
                span.set_attribute("dask.spill.bytes", weight.memory)
                span.set_attribute("dask.spill.disk_bytes", weight.disk)
        except Exception:
            _tracing_failed()


class _SpillScope:
    """Ends a spill span; a failure (unpicklable data, disk full, max-spill) is an ERROR."""

    def __init__(self, span: trace.Span, limit: int) -> None:
        self.span = span
        self.limit = limit

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None:
                # Dask wraps a pickling failure; the cause says what could not be pickled.
                cause = exc.__cause__ if isinstance(exc, PickleError) else None
                errors.record_exception(self.span, cause or exc, None, None, self.limit)
            self.span.end()
        except Exception:
            _tracing_failed()


def _tracing_failed() -> None:
    report_once(logger, "spill", "dask-otel: spill tracing failed (said once)")


class SpillTracer:
    """Puts :class:`TracedDisk` into one worker's spill buffer and labels why it spills."""

    def __init__(self, worker: Worker, tracer: trace.Tracer, attributes: dict, limit: int):
        self.worker = worker
        self.buffer = worker.data
        self.cache = self.buffer.slow
        self.disk = TracedDisk(self.cache.data, worker, tracer, attributes, limit)
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
