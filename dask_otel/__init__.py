"""OpenTelemetry for Dask: traces, metrics and logs of a whole cluster over OTLP.

Three ways in:

* ``opentelemetry-instrument dask-scheduler ...`` / ``dask-worker ...``: zero code; the
  ``dask`` instrumentor and the ``dask_otel`` configurator are entry points.
* :func:`instrument` in client code: this process and the cluster behind a client.
* ``--preload dask_otel`` on ``dask scheduler`` / ``dask worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
from collections.abc import Awaitable, Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from dask_otel import hooks, runtime
from dask_otel.package import _instruments
from dask_otel.plugins import carried, own_runs
from dask_otel.plugins.activation import (
    activate,
    bridge_logs,
    disabled_by_environment,
    refuse_invalid_settings,
    settings_problem,
)
from dask_otel.runtime import PLUGIN_NAME, say_once
from dask_otel.version import __version__

__all__ = [
    "ConfigError",
    "DaskInstrumentor",
    "DaskOtelNannyPlugin",
    "DaskOtelSchedulerPlugin",
    "DaskOtelWorkerPlugin",
    "__version__",
    "dask_setup",
    "instrument",
    "uninstrument",
]

#: What this package exports from modules that import ``distributed``, by module:
#: imported when first used, so that importing the instrumentor does not import Dask.
_LAZY = {
    "ConfigError": "dask_otel.config",
    "DaskOtelNannyPlugin": "dask_otel.plugins.nanny",
    "DaskOtelSchedulerPlugin": "dask_otel.plugins.scheduler",
    "DaskOtelWorkerPlugin": "dask_otel.plugins.worker",
    "dask_setup": "dask_otel.preload",  # Dask's preloads look it up with getattr
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


class DaskInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Traces every client, scheduler and worker created in this process.

    ``instrument(tracer_provider=..., meter_provider=..., logger_provider=...)`` uses the
    given providers (the global ones otherwise); ``uninstrument()`` stops tracing new
    objects.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        refuse_invalid_settings()  # `opentelemetry-instrument dask worker`, bad settings
        runtime.set_overrides(
            tracer_provider=kwargs.get("tracer_provider"),
            meter_provider=kwargs.get("meter_provider"),
            logger_provider=kwargs.get("logger_provider"),
        )
        hooks.install()
        if not kwargs and runtime.is_configured() and not disabled_by_environment():
            # opentelemetry-instrument configures the SDK before it loads instrumentors:
            # log records are exported from dask's import on (its config holds otel.*),
            # not from the first Dask object on.
            hooks.when_imported("dask", _bridge_logs_from_the_start)

    def _uninstrument(self, **kwargs: Any) -> None:
        from dask_otel.signals import logs

        hooks.uninstall()
        if "distributed" in sys.modules:  # else no RPC was ever traced
            from dask_otel.plugins import rpc

            rpc.uninstall()
        logs.uninstall()
        runtime.set_overrides()


def _bridge_logs_from_the_start() -> None:
    """Export log records from now on, unless the instrumentor was turned off since."""
    from dask_otel.config import ConfigError, load_settings

    if hooks.is_installed():
        with contextlib.suppress(ConfigError):  # said when a Dask object activates
            settings = load_settings()
            if settings.enabled:
                bridge_logs(settings)


def instrument(client: Any = None, **providers: Any) -> Awaitable[None] | None:
    """Trace this process and, given a ``distributed.Client``, the cluster behind it.

    Configures the OpenTelemetry SDK from ``OTEL_*`` variables unless providers are
    passed (``tracer_provider=``, ``meter_provider=``, ``logger_provider=``) or something
    configured it already, then registers dask-otel's plugins on the scheduler and on
    every current and future worker. Calling it again changes nothing. With an
    asynchronous client it returns an awaitable, as the client's own methods do:
    ``await dask_otel.instrument(client)``.
    """
    instrumentor = DaskInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(**providers)
    active = activate("client") is not None  # off: registers nothing, says why once
    if client is None:
        return None
    return client.sync(_register_plugins, client, active)


async def _register_plugins(client: Any, active: bool) -> None:
    if not active:
        return
    from dask_otel.plugins import portable
    from dask_otel.plugins.nanny import DaskOtelNannyPlugin
    from dask_otel.plugins.scheduler import DaskOtelSchedulerPlugin
    from dask_otel.plugins.worker import DaskOtelWorkerPlugin

    client.subscribe_topic(portable.TOPIC, _said_absent)
    # Only where dask-otel is installed: elsewhere a run of its functions fails loudly.
    found = await client.run(portable.PROBE, on_error="return")
    installed = [address for address, importable in found.items() if importable is True]
    # What the cluster's processes will say on their own stderr, said here too.
    problems = {"scheduler": await client.run_on_scheduler(settings_problem)}
    workers = await client.run(settings_problem, workers=installed) if installed else {}
    problems.update({f"worker {address}": problem for address, problem in workers.items()})
    for where, problem in problems.items():
        if isinstance(problem, str):
            say_once(f"{problem}. dask-otel is off in the {where}, which runs on, untraced.")
    # This client's settings of what leaves the cluster, in its processes now and in
    # those the plugins reach later; where a process's own are stricter, they stay.
    asked = carried.asked()
    if asked:
        await _carry(client, asked, installed)
    await client.register_plugin(DaskOtelSchedulerPlugin(asked))
    # Nannies first: a worker finds its Nanny's flight recorder directory at setup.
    await client.register_plugin(portable.PortableNannyPlugin(DaskOtelNannyPlugin(asked)))
    await client.register_plugin(portable.PortableWorkerPlugin(DaskOtelWorkerPlugin(asked)))
    for event in await client.get_events(portable.TOPIC):  # said before the subscription
        _said_absent(event)


def _said_absent(event: tuple[float, dict[str, str]]) -> None:
    """A process where dask-otel is not installed said so (its plugin's event)."""
    from dask_otel.plugins import portable

    _, where = event
    say_once(portable.absent_message(where["role"], where["address"]))


async def _carry(client: Any, asked: dict[str, Any], installed: list[str]) -> None:
    """Apply ``asked`` in the processes running now; say where their own stays."""
    kept = {"the scheduler": await client.run_on_scheduler(carried.apply_asked, asked)}
    workers = await client.run(carried.apply_asked, asked, workers=installed) if installed else {}
    kept.update({f"worker {address}": settings for address, settings in workers.items()})
    for where, settings in kept.items():
        if isinstance(settings, list) and settings:
            say_once(
                f"{where} keeps its own {', '.join(settings)}, stricter than this client's "
                "(the stricter setting wins)"
            )


def uninstrument(client: Any = None) -> Awaitable[None] | None:
    """Undo :func:`instrument`: unregister the plugins and restore this process (an
    awaitable with an asynchronous client)."""
    if client is not None and client.asynchronous:
        return _uninstrument_asynchronous(client)
    if client is not None:
        client.sync(_unregister_plugins, client)
    DaskInstrumentor().uninstrument()  # in the caller's thread: it may wait for a flush
    return None


async def _uninstrument_asynchronous(client: Any) -> None:
    await _unregister_plugins(client)
    await asyncio.get_running_loop().run_in_executor(None, DaskInstrumentor().uninstrument)


async def _unregister_plugins(client: Any) -> None:
    registered = await client.run_on_scheduler(_detach_scheduler_plugin)
    for nanny in registered:  # Dask logs an ERROR for a plugin it does not have
        with contextlib.suppress(ValueError):  # unregistered meanwhile by another client
            await client.unregister_worker_plugin(PLUGIN_NAME, nanny=nanny)


@own_runs.register
async def _detach_scheduler_plugin(dask_scheduler: Any) -> list[bool]:
    """Runs on the scheduler: flush and remove its dask-otel plugin; which of dask-otel's
    worker (False) and Nanny (True) plugins it has registered."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        await plugin.close()
        dask_scheduler.remove_plugin(name=PLUGIN_NAME)
    kinds = {False: dask_scheduler.worker_plugins, True: dask_scheduler.nanny_plugins}
    return [nanny for nanny, plugins in kinds.items() if PLUGIN_NAME in plugins]
