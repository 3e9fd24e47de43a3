"""The functions dask-otel runs on a cluster's processes (``client.run``,
``run_on_scheduler``: checking their settings, removing its plugin) leave no ``Run
out-of-band function`` line in those processes' logs, which are the user's: Dask logs one
for every call, and says nothing else of them unless they fail.

Each module that defines such a function registers it here at import, which on the
receiving process happens as the function is unpickled, before Dask logs the line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

#: The message distributed's ``run`` logs, with the function's name as its one argument.
_RUN_MESSAGE = "Run out-of-band function %r"
_names: set[str] = set()


class _OwnRuns(logging.Filter):
    """Drops the line of a run of a function dask-otel registered."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _RUN_MESSAGE or not isinstance(record.args, tuple):
            return True
        return not (record.args and record.args[0] in _names)


_FILTER = _OwnRuns()


def register(function: Callable[..., Any]) -> Callable[..., Any]:
    """Leave runs of ``function`` unlogged in this process (a decorator)."""
    _names.add(function.__name__)
    logger = logging.getLogger("distributed.worker")  # the scheduler's runs log there too
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return function
