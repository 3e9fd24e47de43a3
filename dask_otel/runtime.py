"""The one owner of dask-otel's per-process state.

Where its components get their tracer, meter and logger provider (a plugin object may be
pickled and shipped to another process, so it never carries providers itself: it asks
this module when it starts; the providers handed to ``DaskInstrumentor().instrument(...)``
in this process win, otherwise the global ones); what the exports tell of the collector
(:class:`ExportHealth`); the fork gate and the one after-fork handler; the one exit
handler; the demand for metrics on a schedule; and what is said once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import _logs, metrics, trace

from dask_otel.version import __version__

if TYPE_CHECKING:
    from dask_otel.config import Settings

#: Instrumentation scope of every span, metric and log record dask-otel makes.
SCOPE = "dask_otel"
#: Name of dask-otel's scheduler and worker plugins.
PLUGIN_NAME = "dask-otel"

_overrides: dict[str, Any] = {}


@dataclass(frozen=True)
class Providers:
    tracer_provider: trace.TracerProvider
    meter_provider: metrics.MeterProvider
    logger_provider: _logs.LoggerProvider

    def tracer(self) -> trace.Tracer:
        return self.tracer_provider.get_tracer(SCOPE, __version__)


def set_overrides(**providers: Any) -> None:
    """Use these providers (None entries fall back to the globals) from now on."""
    _overrides.clear()
    _overrides.update({name: p for name, p in providers.items() if p is not None})


def current() -> Providers:
    """The providers dask-otel components in this process should use now."""
    return Providers(
        tracer_provider=_overrides.get("tracer_provider") or trace.get_tracer_provider(),
        meter_provider=_overrides.get("meter_provider") or metrics.get_meter_provider(),
        logger_provider=_overrides.get("logger_provider") or _logs.get_logger_provider(),
    )


def is_configured() -> bool:
    """Whether anything (dask-otel, a distro or the user) set a real tracer provider."""
    return "tracer_provider" in _overrides or not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    )


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
#: A Nanny asks its worker to close and kills it 4 s later (0.8 x the 5 s timeout of
#: ``Nanny.close``, ``Nanny.kill`` and ``Nanny.restart`` in distributed): a worker under
#: a Nanny flushes at most this long when it closes, and its exit waits at most
#: :data:`NANNY_EXIT` more, well within that grace.
NANNY_FLUSH = 1.5
NANNY_EXIT = 0.5


class ExportHealth:
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

    def started(self) -> None:
        with self._lock:
            self._running[threading.get_ident()] = time.monotonic()

    def progress(self) -> None:
        """A request of the export under way in this thread went through (a batch may take
        several)."""
        with self._lock:
            now = self.last_success = time.monotonic()
            if threading.get_ident() in self._running:
                self._running[threading.get_ident()] = now

    def finished(self, ok: bool) -> None:
        with self._lock:
            self._running.pop(threading.get_ident(), None)
            if ok:
                self.last_success = time.monotonic()
            else:
                self.last_failure = time.monotonic()

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
        for ``patience`` seconds (infinity when dask-otel does not export here)."""
        if not self.watched:
            return float("inf")
        return max(since, self.last_success) + patience

    def forget_parent(self) -> None:
        """In a forked child: the parent's exports under way are not this process's."""
        self._lock = threading.Lock()
        self._running = {}

    def patience(self) -> float:
        """How long a wait beginning now goes on without an export succeeding."""
        if self.stuck():
            return 0.0
        return GRACE if self.last_failure > self.last_success else self._limit()


#: The one per process (a forked child inherits what its parent saw of the collector).
health = ExportHealth()


class ForkGate:
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

    def __init__(self) -> None:
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


#: Longest a fork waits for dask-otel's work under way.
FORK_WAIT = 0.5
#: The one per process.
fork_gate = ForkGate()


class MetricDemand:
    """Whether this process has metrics to report on a schedule: while a scheduler, worker
    or Nanny of dask-otel's runs in it (each holds the demand from its start to its
    close), and for good once anything but dask-otel asked for a meter.

    The metric readers dask-otel configures (:mod:`dask_otel.distro.readers`) run their
    thread only then, so that a process that never uses Dask runs no thread of
    dask-otel's, and a closed cluster leaves none behind (distributed's tests check both).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: ``id()`` of each server holding the demand (the server itself is not kept).
        self._held: set[int] = set()
        #: Something other than dask-otel made a meter: its instruments may record any time.
        self._always = False
        #: Called with :meth:`wanted` whenever it changes (under the lock: never call back).
        self._listeners: list[Callable[[bool], None]] = []

    def hold(self, server: object) -> None:
        with self._lock:
            self._held.add(id(server))
            self._tell()

    def release(self, server: object) -> None:
        with self._lock:
            self._held.discard(id(server))
            self._tell()

    def always(self) -> None:
        with self._lock:
            if not self._always:
                self._always = True
                self._tell()

    def wanted(self) -> bool:
        return self._always or bool(self._held)

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
        self._held = set()


#: The one per process.
metric_demand = MetricDemand()


#: What the other modules of dask-otel forget in a forked child, in the order they asked.
_forgetters: list[Callable[[], None]] = []


def forget_in_child(forget: Callable[[], None]) -> None:
    """Call ``forget`` in each forked child, once this module forgot its parent's state:
    dask-otel's one after-fork handler calls them all, in the order asked (a module
    imported later forgets later)."""
    _forgetters.append(forget)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # report_once's, which a parent's thread may have held
    health.forget_parent()
    fork_gate.forget_parent()
    metric_demand.forget_parent()
    for forget in _forgetters:
        try:
            forget()
        except Exception:  # the next ones forget theirs all the same
            report_once(logging.getLogger(__name__), "forgetting", "dask-otel: %r failed", forget)


os.register_at_fork(after_in_child=_after_fork_in_child)

#: What this process does at exit, stage by stage: build the telemetry still pending (the
#: span emitters' backlog), then export it (the SDK's shutdown).
_exit_steps: dict[str, list[Callable[[], None]]] = {"build": [], "export": []}


def at_exit(stage: str, step: Callable[[], None]) -> None:
    """Call ``step`` at exit in ``stage`` (``build``, then ``export``), once however often
    asked. dask-otel's one exit handler is registered again now: atexit calls the last
    registered first, so it comes before the shutdown of every provider made so far (the
    SDK registers one for each), whatever the order its steps were asked in."""
    if step not in _exit_steps[stage]:
        _exit_steps[stage].append(step)
    atexit.unregister(_exit)
    atexit.register(_exit)


def _exit() -> None:
    for steps in _exit_steps.values():
        for step in steps:
            try:
                step()
            except Exception:  # the next ones run all the same
                report_once(logging.getLogger(__name__), "exit", "dask-otel: %r failed", step)


#: Longest the exit of this process waits for its telemetry when less than
#: ``otel.flush-timeout``: a Nanny's worker, once it closed (:data:`NANNY_EXIT`).
exit_limit: float | None = None


def closing_under_nanny(flush_timeout: float) -> float:
    """How long a closing worker under a Nanny may flush; its exit then waits at most
    :data:`NANNY_EXIT`, so that its Nanny never kills it for dask-otel's sake."""
    global exit_limit
    exit_limit = NANNY_EXIT
    return min(flush_timeout, NANNY_FLUSH)


def flush(providers: Providers, timeout: float) -> bool:
    """Export what the providers hold, waiting at most ``timeout`` seconds in all, and no
    longer than the collector keeps taking batches (see :class:`ExportHealth`).

    The SDK's ``force_flush`` can outlast its own timeout against a stalled collector
    (the exporter's retries run to completion), so each provider flushes in a daemon
    thread and the caller stops waiting at the deadline. True if all finished in time.
    """
    return _bounded("force_flush", providers, timeout, {"timeout_millis": int(timeout * 1000)})


def shutdown(providers: Providers, timeout: float) -> bool:
    """Shut the providers down (a last export), waiting as :func:`flush` does.

    The SDK's own shutdown joins each batch processor for up to 30 s while its exporter
    retries against an unreachable collector; here the caller stops waiting at the
    deadline, or once the collector has answered nothing for a moment, and leaves the
    rest to daemon threads.
    """
    return _bounded("shutdown", providers, timeout, {})


def _bounded(method: str, providers: Providers, timeout: float, kwargs: dict[str, Any]) -> bool:
    """Call ``method`` of every provider in daemon threads; wait at most ``timeout``, and
    no longer than :data:`health` allows."""
    started = time.monotonic()
    deadline = started + timeout
    patience = health.patience()
    threads = []
    for provider in (
        providers.tracer_provider,
        providers.logger_provider,
        providers.meter_provider,
    ):
        call = getattr(provider, method, None)
        if call is not None:
            thread = threading.Thread(
                target=_quietly,
                args=(call, kwargs),
                name=f"dask-otel-{method.replace('_', '-')}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
    for thread in threads:
        while thread.is_alive():
            stop = min(deadline, health.give_up_at(started, patience))
            now = time.monotonic()
            if now >= stop:
                health.gave_up()
                return False
            thread.join(min(stop - now, 0.05))
    return True


def _quietly(call: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """``call(**kwargs)``; what it raises is logged at debug level, never printed: the SDK's
    ``MeterProvider.force_flush`` raises when a collection outlasts its timeout (a loaded
    machine), and a thread's exception would reach stderr as a traceback."""
    try:
        call(**kwargs)
    except Exception:
        logging.getLogger(__name__).debug("dask-otel: %r failed", call, exc_info=True)


# -- said once ------------------------------------------------------------------------

_reported: set[str] = set()
_lock = threading.Lock()


def first_time(key: str) -> bool:
    """True the first time ``key`` comes up in this process: what is said once."""
    with _lock:
        if key in _reported:
            return False
        _reported.add(key)
        return True


def forget_said(*keys: str) -> None:
    """Let ``keys`` come up as if for the first time again (tests of what is said once)."""
    with _lock:
        _reported.difference_update(keys)


def settings_if_dask_imported() -> Settings | None:
    """dask-otel's settings, if this process has imported Dask: one that never does is not
    made to import it for a setting. None otherwise, and when they cannot be read (invalid,
    which is said where dask-otel activates; or Dask being imported still)."""
    if "dask" not in sys.modules:
        return None
    from dask_otel.config import load_settings

    try:
        return load_settings()
    except Exception:
        return None


def report_once(logger: logging.Logger, key: str, message: str, *args: object) -> None:
    """Log ``message`` at ERROR (with the current exception, if any) the first time
    ``key`` comes up in this process; stay silent after that."""
    if first_time(key):
        logger.error(message, *args, exc_info=sys.exc_info()[0] is not None)


def say_once(message: str) -> None:
    """Write ``dask-otel: message`` on one line of stderr, once per process.

    For what the person who started the process must see (a setting dask-otel cannot
    use), whatever logging is configured: not through logging, which may send it
    only to an exporter, or nowhere.
    """
    if first_time(f"say: {message}"):
        try:
            sys.stderr.write(f"dask-otel: {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # no stderr, or a closed one
            pass


def start_daemon(
    logger: logging.Logger, target: Callable[[], None], name: str, purpose: str
) -> threading.Thread | None:
    """Run ``target`` in a new daemon thread called ``name``; None if the interpreter
    cannot start one (out of threads: said once, naming its ``purpose``), for the caller
    to try again later."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError as e:
        report_once(logger, f"thread {name}", "dask-otel: no thread for %s: %r", purpose, e)
        return None
    return thread
