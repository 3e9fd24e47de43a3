"""Telemetry problems are said once per process, never raised into Dask."""

from __future__ import annotations

import logging
import sys
import threading

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
