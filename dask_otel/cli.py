"""The dashed ``dask-scheduler`` and ``dask-worker`` commands.

``distributed`` dropped them for ``dask scheduler`` / ``dask worker``, but
``opentelemetry-instrument dask-worker ...`` is what OpenTelemetry users type. These run
the very same click commands, with the same options.
"""

from __future__ import annotations

from distributed.cli import dask_scheduler as _scheduler_cli
from distributed.cli import dask_worker as _worker_cli


def dask_scheduler() -> None:
    """``dask-scheduler``: ``dask scheduler`` under its old name."""
    _scheduler_cli.main(prog_name="dask-scheduler")


def dask_worker() -> None:
    """``dask-worker``: ``dask worker`` under its old name."""
    _worker_cli.main(prog_name="dask-worker")
