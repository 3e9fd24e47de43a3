"""``--preload dask_otel``: instrument the scheduler, worker or Nanny it runs in.

Works with ``dask scheduler --preload dask_otel``, ``dask worker --preload dask_otel``
and the ``distributed.{scheduler,worker,nanny}.preload`` config. The plugins do the work;
this module only attaches them. (Clients use :func:`dask_otel.instrument`.)
"""

from __future__ import annotations

from typing import Any

from distributed import Nanny, Scheduler, Worker

from dask_otel.patches import with_plugin
from dask_otel.plugins.activation import check_settings, refuse_invalid_settings
from dask_otel.plugins.nanny import DaskOtelNannyPlugin
from dask_otel.plugins.scheduler import DaskOtelSchedulerPlugin
from dask_otel.plugins.worker import DaskOtelWorkerPlugin

# `dask worker --preload dask_otel` imports this module in its own process while it reads
# its options: invalid settings stop it there, before a Nanny starts a worker process
# that would fail under it (with the Nanny's tracebacks after the line).
refuse_invalid_settings()


async def dask_setup(server: Any) -> None:
    """Preload hook: attach dask-otel's plugin to ``server``."""
    if isinstance(server, Scheduler):
        if DaskOtelSchedulerPlugin.name not in server.plugins:
            server.add_plugin(DaskOtelSchedulerPlugin())  # started by Scheduler.start
    elif isinstance(server, Worker):
        check_settings("worker", server)
        # Plugins given to the constructor (dask-otel's hooks) are added after preloads.
        present = (*server.plugins.values(), *getattr(server, "_pending_plugins", ()))
        if with_plugin(present, DaskOtelWorkerPlugin) != present:
            await server.plugin_add(DaskOtelWorkerPlugin(), catch_errors=False)
    elif isinstance(server, Nanny):
        check_settings("nanny", server)
        # Preloads run once the Nanny listens, before its worker process starts (and
        # adds the worker plugin, which the Nanny passes to it).
        plugins = server.worker_kwargs.get("plugins")
        server.worker_kwargs["plugins"] = with_plugin(plugins, DaskOtelWorkerPlugin)
        if DaskOtelNannyPlugin.name not in server.plugins:
            await server.plugin_add(DaskOtelNannyPlugin())
