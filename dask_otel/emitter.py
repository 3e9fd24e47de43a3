"""A daemon thread that turns compact records into spans, off the event loop.

Building a span through the SDK costs ~15 us; the scheduler's event loop only appends a
record and moves on. ``flush`` lets a closing component wait, boundedly, for the backlog.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class SpanEmitter:
    """Runs ``emit(record)`` for every submitted record in one background thread."""

    def __init__(self, emit: Callable[[Any], None], name: str) -> None:
        self._emit = emit
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._failed = False
        self._thread.start()

    def submit(self, record: Any) -> None:
        self._queue.put(record)

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
            record = self._queue.get()
            if record is None:
                return
            if isinstance(record, threading.Event):
                record.set()
                continue
            try:
                self._emit(record)
            except Exception:
                if not self._failed:
                    self._failed = True
                    logger.exception("dask-otel: failed to build a span; later failures are silent")
