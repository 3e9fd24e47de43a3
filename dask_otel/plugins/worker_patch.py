"""What replaces a method of one worker while dask-otel traces it, and the one report
of a failure to trace on a worker."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_otel.runtime import report_once

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from distributed import Worker

logger = logging.getLogger(__name__)


def tracing_failed() -> None:
    report_once(logger, "worker", "dask-otel: tracing on a worker failed (said once)")


class InstancePatch:
    """Replaces the method ``name`` of one worker with ``self.<name>``, and back."""

    name: str

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.original: Callable[..., Awaitable[Any]] = getattr(worker, self.name)

    def install(self) -> None:
        setattr(self.worker, self.name, getattr(self, self.name))

    def uninstall(self) -> None:
        if self.worker.__dict__.get(self.name) == getattr(self, self.name):
            delattr(self.worker, self.name)
