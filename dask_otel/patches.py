"""Patches that attach dask-otel to every Dask object created in an instrumented process
(applied by :mod:`dask_otel.hooks` once ``distributed`` is imported).

Each scheduler gets the scheduler plugin, each worker (and each Nanny's worker process,
whatever its multiprocessing method) the worker plugin, through the ``plugins`` argument
their constructors already take; each Nanny runs ``dask_otel`` as a Nanny preload, as
``--preload-nanny dask_otel`` would (it adds the Nanny plugin once the Nanny listens,
before its worker starts); every client's submissions get a span
(:func:`dask_otel.plugins.client.trace_submissions`). Objects created after
:func:`remove` are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import dask.config
import distributed
from wrapt import wrap_function_wrapper

from dask_otel.plugins import activation, client
from dask_otel.plugins.scheduler import DaskOtelSchedulerPlugin
from dask_otel.plugins.worker import DaskOtelWorkerPlugin
from dask_otel.spans import errors


def with_plugin(plugins: Iterable[Any] | None, plugin_type: type) -> tuple[Any, ...]:
    """``plugins`` plus a new ``plugin_type()``, unless one of that name is there."""
    plugins = tuple(plugins or ())
    if any(getattr(p, "name", None) == plugin_type.name for p in plugins):
        return plugins
    return (*plugins, plugin_type())


def _with_plugin(plugin_type: type, role: str) -> Any:
    """A constructor wrapper that passes :func:`with_plugin` as ``plugins=``, the process
    prepared for ``role`` first (:func:`~dask_otel.plugins.activation.prepare_process`:
    a worker process logs before its plugin starts)."""

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        activation.prepare_process(role)
        kwargs["plugins"] = with_plugin(kwargs.get("plugins"), plugin_type)
        try:
            return wrapped(*args, **kwargs)
        except BaseException as e:
            errors.hide_frame(e)  # a bad argument's traceback shows Dask's frames only
            raise

    return wrapper


#: The module Dask imports as a preload (its ``dask_setup``).
PRELOAD = "dask_otel"


def _nanny_with_plugins(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``Nanny(...)`` with the worker plugin for its worker and ``dask_otel`` preloaded."""
    kwargs["plugins"] = with_plugin(kwargs.get("plugins"), DaskOtelWorkerPlugin)
    preloads = kwargs.get("preload_nanny")
    if preloads is None:
        preloads = dask.config.get("distributed.nanny.preload")
    preloads = [preloads] if isinstance(preloads, str) else list(preloads or ())
    if PRELOAD not in preloads:
        kwargs["preload_nanny"] = [*preloads, PRELOAD]
        argv = kwargs.get("preload_nanny_argv")
        if argv is None:
            argv = dask.config.get("distributed.nanny.preload-argv")
        if argv and not isinstance(argv[0], str):  # one list per preload
            kwargs["preload_nanny_argv"] = [*argv, []]
    return wrapped(*args, **kwargs)


_PATCHES = (
    (distributed.Scheduler, "__init__", _with_plugin(DaskOtelSchedulerPlugin, "scheduler")),
    (distributed.Worker, "__init__", _with_plugin(DaskOtelWorkerPlugin, "worker")),
    # A Nanny passes unknown keyword arguments to its Worker: the plugin is pickled into
    # the worker process with spawn, fork and forkserver alike.
    (distributed.Nanny, "__init__", _nanny_with_plugins),
)


def apply() -> None:
    client.trace_submissions(client.ALL)
    for owner, attribute, wrapper in _PATCHES:
        wrap_function_wrapper(owner, attribute, wrapper)


def remove() -> None:
    client.untrace_submissions(client.ALL)
    for owner, attribute, _ in _PATCHES:
        original = getattr(owner.__dict__[attribute], "__wrapped__", None)
        if original is not None:
            setattr(owner, attribute, original)
