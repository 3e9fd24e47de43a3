"""A daemon thread that builds spans from compact records, off the event loop.

Building a span through the SDK costs many times what appending a record does: the event
loops only append one and move on. ``flush`` lets a closing component wait, boundedly,
for the backlog.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from time import perf_counter, sleep
from typing import Any

from dask_otel import runtime
from dask_otel.runtime import report_once, start_daemon
from dask_otel.runtime_state import ProcessState

logger = logging.getLogger(__name__)


#: Seconds of work between two pauses, and the pause. CPython hands the GIL to a thread
#: that asks for it when the holder blocks, or else only after the switch interval
#: (5 ms): an emitter working through its backlog in one go keeps the event loop waiting
#: up to 5 ms each time a message arrives, on the path from one task to the next. A real
#: sleep (``sleep(0)`` hands nothing over) after each slice bounds that wait to about a
#: slice. A loop that keeps the GIL busy would then leave the emitter one slice every
#: switch interval: with a backlog of ``PAUSE_BELOW`` records it works without pausing.
SLICE = 0.001
PAUSE = 0.0001
PAUSE_BELOW = 1000


class SpanEmitter:
    """Runs submitted calls one after the other in a background thread, in batches.

    ``submit`` only appends to a deque: waking the thread for every record would hand it
    the GIL once per task and stall the event loop each time. The thread wakes every
    ``interval`` seconds (or when flushed), works through everything submitted (pausing
    every :data:`SLICE` seconds of work, so that the event loop gets the GIL), and ends
    after ``idle`` seconds without work (a server stopped without ``close`` leaves no
    thread behind); the next ``submit`` starts a new one.
    """

    def __init__(self, name: str, interval: float = 0.1, idle: float = 1.0) -> None:
        emitters.add(self)
        self._name = name
        self._pending: deque[Any] = deque()
        self._wake = threading.Event()
        self._interval = interval
        self._idle_rounds = max(1, round(idle / interval))
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Set by :meth:`close`: the thread ends as soon as it has nothing to do.
        self._closing = False

    def submit(self, emit: Callable[..., None], *args: Any) -> None:
        """Call ``emit(*args)`` in the background thread, after everything before it."""
        # One tuple per call: everything queued outlives a young garbage collection or two
        # and ages into the oldest generation, where each object brings the next full
        # collection (a walk over Dask's whole heap) a little closer.
        self._pending.append((emit, *args))
        if self._thread is None:
            self._start()

    @property
    def backlog(self) -> int:
        """Calls submitted and not taken by the thread yet (for tests and benchmarks)."""
        return len(self._pending)

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is emitted; False on timeout."""
        done = threading.Event()
        self.submit(done.set)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float) -> bool:
        """:meth:`flush`, then end the thread now rather than after ``idle`` seconds: a
        closed cluster leaves no dask-otel thread for anyone (distributed's leak checks
        among them) to wait for. A later ``submit`` starts another. False on timeout."""
        deadline = perf_counter() + timeout
        flushed = self.flush(timeout)
        thread = self._thread
        if thread is None:
            return flushed
        self._closing = True
        self._wake.set()
        thread.join(max(0.0, deadline - perf_counter()))
        return flushed and not thread.is_alive()

    def _drain_at_exit(self, timeout: float) -> None:
        """What is still pending, emitted before the SDK's own exit shutdown exports it:
        the call the thread is in the middle of (a Nanny's post-mortem, say) too."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self.flush(timeout)
            return
        while self._pending:  # no thread (or no new thread at exit): emit right here
            self._emit(self._pending.popleft())

    def _start(self) -> None:
        """Start the thread; if the interpreter cannot (out of threads), say so once and
        keep the backlog for the next ``submit`` to try again: never fail the caller."""
        with self._lock:
            if self._thread is None:
                self._closing = False
                self._thread = start_daemon(logger, self._run, self._name, "spans")

    def _run(self) -> None:
        pending = self._pending
        idle = 0
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            idle = 0 if pending else idle + 1
            pause_at = perf_counter() + SLICE
            while pending:
                self._emit(pending.popleft())
                if perf_counter() > pause_at and len(pending) < PAUSE_BELOW:
                    sleep(PAUSE)
                    pause_at = perf_counter() + SLICE
            if (self._closing or idle >= self._idle_rounds) and self._retire():
                return

    @staticmethod
    def _emit(call: tuple[Any, ...]) -> None:
        try:
            call[0](*call[1:])
        except Exception:
            report_once(logger, "emit", "dask-otel: building a span failed (said once)")

    def forget_parent(self) -> None:
        """In a forked child: the parent's thread is not here, and what it had queued is
        the parent's to emit (the child would emit it twice, at its exit)."""
        self._pending.clear()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = None

    def _retire(self) -> bool:
        """End this thread unless work arrived: ``submit`` sees None and starts another."""
        with self._lock:
            self._thread = None
            if not self._pending:
                return True
            self._thread = threading.current_thread()
            return False


#: Longest the exit waits for each emitter's backlog.
EXIT_TIMEOUT = 2.0


class Emitters(ProcessState):
    """Every emitter of this process, so that what they hold at interpreter exit is not
    lost (a client's ``LocalCluster`` left for the interpreter to close, a script that
    ends right away), and the one every dask-otel component shares (:func:`shared`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Every emitter made in this process.
        self._all: weakref.WeakSet[SpanEmitter] = weakref.WeakSet()
        #: The shared one, once a component asked for it.
        self._shared: SpanEmitter | None = None

    def add(self, emitter: SpanEmitter) -> None:
        self._all.add(emitter)
        self._drain_before_sdk_exit()

    def shared(self) -> SpanEmitter:
        with self._lock:
            if self._shared is None:
                self._shared = SpanEmitter(name="dask-otel-spans")
            else:
                self._drain_before_sdk_exit()
            return self._shared

    def _drain_before_sdk_exit(self) -> None:
        """The drain comes before the SDK's exit shutdown and export (asked again as each
        component starts: after the SDK was configured, see ``runtime.at_exit``)."""
        runtime.at_exit("build", self._drain_all_at_exit)

    def _drain_all_at_exit(self) -> None:
        for emitter in list(self._all):
            emitter._drain_at_exit(EXIT_TIMEOUT)

    def forget_parent(self) -> None:
        """A child forked while an emitter's thread ran (a Nanny's worker started with the
        ``fork`` method, in a process whose scheduler or client traces) starts threads of
        its own: otherwise its emitters would wait forever for a thread that stayed
        behind."""
        self._lock = threading.Lock()
        for emitter in list(self._all):
            emitter.forget_parent()


#: The one per process.
emitters = runtime.own(Emitters())


def shared() -> SpanEmitter:
    """This process's emitter, which every dask-otel component in it (client, scheduler,
    workers, ``rpc`` spans) submits to: one thread to wake and hand the GIL to, however
    many components an in-process cluster has. Asked by each component as it starts."""
    return emitters.shared()


def drain(emitter: SpanEmitter, providers: runtime.Providers, timeout: float) -> None:
    """Emit what ``emitter`` holds, then export it, within ``timeout`` seconds in all
    (building spans takes at most half of it; the export, no longer than the collector
    keeps taking batches: see ``runtime.flush``)."""
    started = perf_counter()
    emitter.close(timeout / 2)
    runtime.flush(providers, timeout - (perf_counter() - started))


async def off_loop(call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)`` (a closing component's :func:`drain`, say) in the event loop's
    executor. At interpreter exit (a cluster left for the interpreter to close) the
    executor takes no more work: then nothing is done here, and nothing is said (Dask
    would print the error on stderr); the exit's own drain and shutdown do what they can."""
    try:
        done = asyncio.get_running_loop().run_in_executor(None, call, *args)
    except RuntimeError:  # cannot schedule new futures after interpreter shutdown
        return
    await done
