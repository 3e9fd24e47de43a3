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

from dask_otel import runtime
from dask_otel.runtime_state import ProcessState

#: The message distributed's ``run`` logs, with the function's name as its one argument.
_RUN_MESSAGE = "Run out-of-band function %r"


class _OwnRuns(logging.Filter, ProcessState):
    """Drops the line of a run of a function dask-otel registered."""

    def __init__(self) -> None:
        super().__init__()
        #: The names of the functions registered.
        self.names: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _RUN_MESSAGE or not isinstance(record.args, tuple):
            return True
        return not (record.args and record.args[0] in self.names)


#: The one per process.
_own_runs = runtime.own(_OwnRuns())


def register(function: Callable[..., Any]) -> Callable[..., Any]:
    """Leave runs of ``function`` unlogged in this process (a decorator)."""
    _own_runs.names.add(function.__name__)
    logger = logging.getLogger("distributed.worker")  # the scheduler's runs log there too
    if _own_runs not in logger.filters:
        logger.addFilter(_own_runs)
    return function
