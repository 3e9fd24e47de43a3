"""What a piece of dask-otel's per-process state must answer (:class:`ProcessState`), and
the state classes behind its background exports: what the exports tell of the collector
(:class:`ExportHealth`), the work a fork must wait for (:class:`ForkGate`), and whether
metrics are wanted on a schedule (:class:`MetricDemand`). :mod:`dask_otel.runtime` holds
the one instance of each for the process, and forgets them in a forked child.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

#: A flush stops waiting once no export of dask-otel's has succeeded for this many
#: seconds (a collector that is down or hung: its exporter retries for up to 10 s a batch);
#: for :data:`SLOW` seconds when the collector's last answer was a success (a large request
#: on a loaded machine is slow, not hung), for :data:`GRACE` seconds when it was a failure
#: (a new export gets through in milliseconds if the collector is back); and at once while
#: an export has been under way for longer than that (nothing else gets through before it
#: ends).
STALL = 0.5
SLOW = 2.0
GRACE = 0.1
#: Longest a fork waits for dask-otel's work under way.
FORK_WAIT = 0.5


class ProcessState:
    """One concern's state in this process. :func:`dask_otel.runtime.own` holds the one
    instance of each kind; every module-level mutable object of dask-otel is one, so that
    one place forgets the parent's in a forked child and resets them for tests."""

    def forget_parent(self) -> None:
        """In a forked child: drop what belonged to the parent's threads and servers, and
        make new locks (a thread of the parent's may have held one at the fork). What
        stays valid in the child (providers, patches) stays."""

    def reset(self) -> None:
        """Forget what was counted and said so far, as in a process that just started
        (tests call it through :func:`dask_otel.runtime.reset`, whatever runs). The
        machinery (threads, patches, providers) is left as it is."""


class Once(ProcessState):
    """Something this process does once, and a forked child once again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def now(self) -> bool:
        """True the first time it is asked; False from then on."""
        if self._done:
            return False
        with self._lock:
            done, self._done = self._done, True
            return not done

    def forget_parent(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def reset(self) -> None:
        self._done = False


class _ForgetsParent(Protocol):
    def forget_parent(self) -> None: ...


Instance = TypeVar("Instance", bound=_ForgetsParent)


class Instances(ProcessState, Generic[Instance]):
    """The live instances of one of dask-otel's classes that run threads or hold locks
    (export queues, metric readers, ...): in a forked child each forgets its parent's."""

    def __init__(self) -> None:
        #: Every live instance, kept no longer than others keep it.
        self._live: weakref.WeakSet[Instance] = weakref.WeakSet()

    def add(self, instance: Instance) -> None:
        self._live.add(instance)

    def __iter__(self) -> Iterator[Instance]:
        """A snapshot: instances made or collected meanwhile do not disturb it."""
        return iter(list(self._live))

    def forget_parent(self) -> None:
        for instance in self:
            instance.forget_parent()


class Outcome:
    """Of one export (see :meth:`ExportHealth.exporting`)."""

    def __init__(self) -> None:
        #: Whether the collector took it, by its exporter's rule; not if the export raised.
        self.ok = False


class ExportHealth(ProcessState):
    """What dask-otel's export queues last saw of the collector.

    Flushes ask it whether to keep waiting: a collector that takes batches keeps a flush
    going (up to its timeout); one that has answered nothing for a while is down or hung,
    and waiting longer would only delay a close or an exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Whether dask-otel's queues export in this process (else there is nothing to go by).
        self.watched = False
        #: When each export under way started (monotonic), by exporting thread.
        self._running: dict[int, float] = {}
        #: When an export last succeeded; when one last failed or a flush gave up (0: never).
        self.last_success = 0.0
        self.last_failure = 0.0
        #: When the collector last refused an attempt (the exporter sleeps before its next).
        self.last_refusal = 0.0

    @contextlib.contextmanager
    def exporting(self) -> Iterator[Outcome]:
        """An export under way in this thread (:meth:`stuck` watches it), then a success
        or a failure: failed unless the caller sets the outcome's ``ok``, for the rule of
        what counts as taken is each exporter's."""
        thread = threading.get_ident()
        with self._lock:
            self._running[thread] = time.monotonic()
        outcome = Outcome()
        try:
            yield outcome
        finally:
            with self._lock:
                self._running.pop(thread, None)
                if outcome.ok:
                    self.last_success = time.monotonic()
                else:
                    self.last_failure = time.monotonic()

    def progress(self) -> None:
        """A request of the export under way in this thread went through (a batch may take
        several)."""
        with self._lock:
            now = self.last_success = time.monotonic()
            if threading.get_ident() in self._running:
                self._running[threading.get_ident()] = now

    def attempt_failed(self) -> None:
        """An attempt of an export under way failed, and its exporter sleeps before the
        next: the collector is taken for down until an export succeeds, without waiting
        for the export's last attempt (seconds later)."""
        with self._lock:
            self.last_failure = self.last_refusal = time.monotonic()

    def gave_up(self) -> None:
        """A flush stopped waiting: the collector is taken for down until an export succeeds."""
        self.last_failure = time.monotonic()

    def _limit(self) -> float:
        """How long the collector may stay silent: :data:`SLOW` if it last answered with
        a success, else :data:`STALL`."""
        return SLOW if self.last_success > self.last_failure else STALL

    def stuck(self) -> bool:
        """Whether an export has been under way with no answer for longer than the
        collector may stay silent (retrying, or waiting for an answer that does not come)."""
        with self._lock:
            oldest = min(self._running.values(), default=None)
        return oldest is not None and time.monotonic() - oldest > self._limit()

    def failing(self) -> bool:
        """Whether the collector is down or hung, as far as the exports tell."""
        return self.stuck() or self.last_failure > self.last_success

    def give_up_at(self, since: float, patience: float) -> float:
        """When a wait that began at ``since`` should stop, no export having succeeded
        for ``patience`` seconds; when the collector refused an attempt during the wait,
        then (the exporter's next attempt is a backoff away, 0.8 s at least). Infinity
        when dask-otel does not export here."""
        if not self.watched:
            return float("inf")
        if self.last_refusal > max(since, self.last_success):
            return self.last_refusal
        return max(since, self.last_success) + patience

    def forget_parent(self) -> None:
        """In a forked child: the parent's exports under way are not this process's."""
        self._lock = threading.Lock()
        self._running = {}

    def reset(self) -> None:
        """Nothing seen of the collector yet."""
        with self._lock:
            self.last_success = self.last_failure = self.last_refusal = 0.0

    def patience(self) -> float:
        """How long a wait beginning now goes on without an export succeeding."""
        if self.stuck():
            return 0.0
        return GRACE if self.last_failure > self.last_success else self._limit()


class ForkGate(ProcessState):
    """Work a fork must not split: dask-otel's exports, and its metric readers'
    collections (which hold the SDK's locks).

    A process forked while one of its threads is inside gRPC inherits that call's locks
    held, and gRPC skips its own fork handlers: the child's exports on that channel wait
    forever (a Nanny's worker started with ``fork`` never exported), and so may its exit,
    which closes the channel; or gRPC aborts the child. So a fork waits for the work under
    way (of other threads), no work starts while it waits, and the wait ends once no
    export has succeeded for a moment (:class:`ExportHealth`) or after :data:`FORK_WAIT`
    at most: the forking thread may be an event loop.

    Its before-fork handler is registered with the first work, after the modules a process
    imports at start-up: handlers run newest first, and ``concurrent.futures`` holds the
    lock every executor submit needs in its own, which must not be held while this one
    waits (an event loop's ``run_in_executor`` would stall for the wait).
    """

    def __init__(self, health: Callable[[], ExportHealth]) -> None:
        #: The process's export health, asked at each fork.
        self._health = health
        self._lock = threading.Lock()
        #: Notified as work ends, and as a fork is done.
        self._changed = threading.Condition(self._lock)
        #: How deep each thread is in work under way (work may nest in work).
        self._depth: dict[int, int] = {}
        #: Forks under way (each thread may fork): no work starts.
        self._forks = 0
        #: Whether the fork handlers are registered (with the first work).
        self._registered = False

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        if not self._registered:
            self._register()
        thread = threading.get_ident()
        with self._lock:
            depth = self._depth.get(thread, 0)
            while self._forks and not depth:
                self._changed.wait()
            self._depth[thread] = depth + 1
        try:
            yield
        finally:
            with self._lock:
                if depth:
                    self._depth[thread] = depth
                else:
                    del self._depth[thread]
                self._changed.notify_all()

    def _register(self) -> None:
        with self._lock:
            if self._registered:
                return
            self._registered = True
        os.register_at_fork(before=self.before_fork, after_in_parent=self.after_fork_in_parent)

    def before_fork(self) -> None:
        started = time.monotonic()
        health = self._health()
        give_up_at = min(health.give_up_at(started, health.patience()), started + FORK_WAIT)
        forking = threading.get_ident()  # its own work (a callback that forks) is not waited for
        with self._lock:
            self._forks += 1
            while any(thread != forking for thread in self._depth):
                remaining = give_up_at - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)

    def after_fork_in_parent(self) -> None:
        with self._lock:
            self._forks -= 1
            self._changed.notify_all()

    def forget_parent(self) -> None:
        """In a forked child: the parent's work and forks are not here."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._depth = {}
        self._forks = 0


class MetricDemand(ProcessState):
    """Whether this process has metrics to report on a schedule: while a scheduler, worker
    or Nanny of dask-otel's runs in it (each holds the demand from its start to its
    close), or a client it traces is open (from its first submission), and for good once
    anything but dask-otel asked for a meter.

    The metric readers dask-otel configures (:mod:`dask_otel.export.metric_readers`) run their
    thread only then, so that a process that never uses Dask runs no thread of
    dask-otel's, and a closed cluster leaves none behind (distributed's tests check both,
    waiting at most 5 s for a thread started during a test to end). The export queues ask
    :meth:`all_closed_since`: what is queued within :data:`LINGER` seconds after the last
    holder closed is the last of it, and no thread waits seconds for the schedule to send
    it (later, batches go on schedule again: a notebook that closed its client keeps them).
    """

    #: Seconds after the last holder closed during which queued items leave at once.
    LINGER = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Each holder (a server or client), by ``id()``: a weak reference (it is not kept
        #: alive) and what tells whether it still runs.
        self._held: dict[int, tuple[weakref.ref, Callable[[Any], bool]]] = {}
        #: Holds taken so far (a holder holding it again counts again).
        self.holds = 0
        #: When the last holder let go (monotonic).
        self._closed_at = -math.inf
        #: Something other than dask-otel made a meter: its instruments may record any time.
        self._always = False
        #: Called with :meth:`wanted` whenever it changes (under the lock: never call back).
        self._listeners: list[Callable[[bool], None]] = []

    def hold(self, holder: Any, running: Callable[[Any], bool]) -> None:
        """Hold it for ``holder`` until :meth:`release`, or until ``running(holder)`` says
        it stopped without closing (distributed's own tests stop servers so)."""
        with self._lock:
            self._held[id(holder)] = (weakref.ref(holder), running)
            self.holds += 1
            self._tell()

    def release(self, holder: Any) -> None:
        with self._lock:
            self._drop([id(holder)])

    def forget_stopped(self) -> None:
        """Release the holders that are gone or stopped without closing. Their checks run
        outside the lock: one may drop the last reference to a client, whose closing
        (``Client.__del__``) releases servers of its own."""
        with self._lock:
            held = list(self._held.items())
        stopped = [key for key, (ref, running) in held if not _runs(ref, running)]
        if stopped:
            with self._lock:
                self._drop(stopped)

    def _drop(self, keys: list[int]) -> None:
        dropped = [key for key in keys if self._held.pop(key, None) is not None]
        if dropped and not self._held:
            self._closed_at = time.monotonic()
        self._tell()

    def always(self) -> None:
        with self._lock:
            if not self._always:
                self._always = True
                self._tell()

    def wanted(self) -> bool:
        return self._always or bool(self._held)

    def unheld(self) -> bool:
        """Whether nothing holds it: no server or traced client ever ran in this process
        (one that only logs through Dask's loggers, say), or every holder has closed or
        stopped since (those that stopped without closing are released now)."""
        self.forget_stopped()
        return not self._held

    def holding(self, holder: Any) -> bool:
        entry = self._held.get(id(holder))
        return entry is not None and entry[0]() is holder

    def all_closed_since(self, holds: int) -> bool:
        """Whether holders held it since :attr:`holds` was ``holds``, none does now, and the
        last one let go less than :data:`LINGER` seconds ago."""
        return (  # held first: the common answer while a server runs, asked per span queued
            not self._held
            and self.holds > holds
            and time.monotonic() - self._closed_at < self.LINGER
        )

    def listen(self, listener: Callable[[bool], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _tell(self) -> None:
        wanted = self.wanted()
        for listener in self._listeners:
            listener(wanted)

    def forget_parent(self) -> None:
        """In a forked child: the parent's servers do not run here (a meter made stays).
        The listeners are not told: they are reset after this, and ask."""
        self._lock = threading.Lock()
        self._held = {}
        self._closed_at = -math.inf


def _runs(ref: weakref.ref, running: Callable[[Any], bool]) -> bool:
    """Whether a holder is alive and, by its own check, still running; a check that fails
    counts as stopped."""
    holder = ref()
    try:
        return holder is not None and running(holder)
    except Exception:
        return False
