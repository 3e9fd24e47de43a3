"""Where dask-otel's components get their tracer, meter and logger provider.

A plugin object may be pickled and shipped to another process, so it never carries
providers itself: it asks this module when it starts. The providers handed to
``DaskInstrumentor().instrument(...)`` in this process win; otherwise the global ones.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import _logs, metrics, trace

from dask_otel.version import __version__

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


#: Whether the last bounded flush in this process gave up (collector down or stalled).
_gave_up = False


def flush(providers: Providers, timeout: float) -> bool:
    """Export what the providers hold, waiting at most ``timeout`` seconds in all.

    The SDK's ``force_flush`` can outlast its own timeout against a stalled collector
    (the exporter's retries run to completion), so each provider flushes in a daemon
    thread and the caller stops waiting at the deadline. True if all finished in time.
    """
    global _gave_up
    done = _bounded("force_flush", providers, timeout, {"timeout_millis": int(timeout * 1000)})
    _gave_up = not done
    return done


def shutdown(providers: Providers, timeout: float) -> bool:
    """Shut the providers down (a last export), waiting at most ``timeout`` seconds.

    The SDK's own shutdown joins each batch processor for up to 30 s while its exporter
    retries against an unreachable collector; here the caller stops waiting at the
    deadline and leaves the rest to daemon threads. When the last flush already gave up,
    only a short grace is spent: the collector is most likely still gone.
    """
    return _bounded("shutdown", providers, min(timeout, 1.0) if _gave_up else timeout, {})


def _bounded(method: str, providers: Providers, timeout: float, kwargs: dict[str, Any]) -> bool:
    """Call ``method`` of every provider in daemon threads; wait at most ``timeout``."""
    deadline = time.monotonic() + timeout
    threads = []
    for provider in (
        providers.tracer_provider,
        providers.logger_provider,
        providers.meter_provider,
    ):
        call = getattr(provider, method, None)
        if call is not None:
            thread = threading.Thread(
                target=call,
                kwargs=kwargs,
                name=f"dask-otel-{method.replace('_', '-')}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


# -- said once ------------------------------------------------------------------------

_reported: set[str] = set()
_lock = threading.Lock()


def _first_time(key: str) -> bool:
    with _lock:
        if key in _reported:
            return False
        _reported.add(key)
        return True


def report_once(logger: logging.Logger, key: str, message: str, *args: object) -> None:
    """Log ``message`` at ERROR (with the current exception, if any) the first time
    ``key`` comes up in this process; stay silent after that."""
    if _first_time(key):
        logger.error(message, *args, exc_info=sys.exc_info()[0] is not None)


def say_once(message: str) -> None:
    """Write ``dask-otel: message`` on one line of stderr, once per process.

    For what the person who started the process must see (a setting dask-otel cannot
    use), whatever logging is configured: not through logging, which may send it
    only to an exporter, or nowhere.
    """
    if _first_time(f"say: {message}"):
        try:
            sys.stderr.write(f"dask-otel: {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # no stderr, or a closed one
            pass
