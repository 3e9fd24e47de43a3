"""Telemetry problems are said once per process, never raised into Dask."""

from __future__ import annotations

import logging
import sys
import threading

_reported: set[str] = set()
_lock = threading.Lock()


def report_once(logger: logging.Logger, key: str, message: str, *args: object) -> None:
    """Log ``message`` at ERROR (with the current exception, if any) the first time
    ``key`` comes up in this process; stay silent after that."""
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    logger.error(message, *args, exc_info=sys.exc_info()[0] is not None)
