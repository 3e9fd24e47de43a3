"""The one owner of dask-otel's per-process state.

Where its components get their tracer, meter and logger provider (a plugin object may be
pickled and shipped to another process, so it never carries providers itself: it asks
this module when it starts; the providers handed to ``DaskInstrumentor().instrument(...)``
in this process win, otherwise the global ones); every other module's state, as the one
instance of a :class:`~dask_otel.runtime_state.ProcessState` it holds (:func:`own`),
forgets in a forked child (the one after-fork handler) and resets for tests
(:func:`reset`); the one exit handler; and what is said once.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import _logs, metrics, trace

from dask_otel.runtime_state import ExportHealth, ForkGate, MetricDemand, ProcessState
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


#: A Nanny asks its worker to close and kills it 4 s later (0.8 x the 5 s timeout of
#: ``Nanny.close``, ``Nanny.kill`` and ``Nanny.restart`` in distributed): a worker under
#: a Nanny flushes at most this long when it closes, and its exit waits at most
#: :data:`NANNY_EXIT` more, well within that grace.
NANNY_FLUSH = 1.5
NANNY_EXIT = 0.5


#: Every piece of per-process state, in the order it was made (:func:`own`).
_owned: list[ProcessState] = []

State = TypeVar("State", bound=ProcessState)


def own(state: State) -> State:
    """Hold ``state`` as this process's one instance of its kind: it is forgotten in every
    forked child and reset by :func:`reset`, in the order owned (a module imported later
    comes later)."""
    _owned.append(state)
    return state


def reset() -> None:
    """Forget what every piece of state counted and said so far, as a new process (tests:
    one test's losses and warnings are not another's)."""
    for state in _owned:
        state.reset()


def _after_fork_in_child() -> None:
    for state in _owned:
        try:
            state.forget_parent()
        except Exception:  # the next ones forget theirs all the same
            report_once(logging.getLogger(__name__), "forgetting", "dask-otel: %r failed", state)


os.register_at_fork(after_in_child=_after_fork_in_child)


class Said(ProcessState):
    """What this process has said once (:func:`first_time`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The keys said so far.
        self._keys: set[str] = set()

    def first_time(self, key: str) -> bool:
        with self._lock:
            if key in self._keys:
                return False
            self._keys.add(key)
            return True

    def forget_parent(self) -> None:
        self._lock = threading.Lock()  # the child has said what its parent said

    def reset(self) -> None:
        with self._lock:
            self._keys.clear()


#: The one per process.
said = own(Said())
#: The one per process (a forked child inherits what its parent saw of the collector).
health = own(ExportHealth())
#: The one per process; it asks the process's :data:`health`.
fork_gate = own(ForkGate(lambda: health))
#: The one per process.
metric_demand = own(MetricDemand())


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
    no longer than :data:`health` allows as the exports go (a first attempt refused
    shortens the wait at once)."""
    started = time.monotonic()
    deadline = started + timeout
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
            stop = min(deadline, health.give_up_at(started, health.patience()))
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


def first_time(key: str) -> bool:
    """True the first time ``key`` comes up in this process: what is said once."""
    return said.first_time(key)


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
