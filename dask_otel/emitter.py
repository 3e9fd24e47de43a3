"""A daemon thread that builds spans from compact records, off the event loop.

Building a span through the SDK costs ~15 us; the scheduler's event loop only appends a
record and moves on. ``flush`` lets a closing component wait, boundedly, for the backlog.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from dask_otel.report import report_once

logger = logging.getLogger(__name__)


class SpanEmitter:
    """Runs submitted calls one after the other in a background thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, emit: Callable[..., None], *args: Any) -> None:
        """Call ``emit(*args)`` in the background thread, after everything before it."""
        self._queue.put((emit, args))

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is emitted; False on timeout."""
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float) -> bool:
        """Emit the backlog (waiting at most ``timeout``) and stop the thread."""
        flushed = self.flush(timeout)
        self._queue.put(None)
        return flushed

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            emit, args = item
            try:
                emit(*args)
            except Exception:
                report_once(logger, "emit", "dask-otel: building a span failed (said once)")
