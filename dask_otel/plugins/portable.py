"""dask-otel's worker and Nanny plugins as they travel to a cluster's processes, so that
one where dask-otel is not installed still starts, untraced.

Dask unpickles a registered plugin in every process that has or gets it (a worker or
Nanny that joins later included) and fails that process's start when the unpickling
fails. :class:`PortableWorkerPlugin` and :class:`PortableNannyPlugin` pickle as a call
of :func:`_arrive`, which cloudpickle carries by value (this module imports only the
standard library and Dask): where dask-otel imports it returns the plugin itself, where
it does not a plugin that does nothing but say so, once, on the process's log and to
the clients listening on :data:`TOPIC`.

Nothing here may use the rest of dask-otel: it runs where dask-otel is absent.
"""

from __future__ import annotations

import importlib.util
import logging
import pickle
import sys
from typing import Any

import cloudpickle
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin
from distributed.protocol import pickle as dask_pickle

#: The event topic on which a process without dask-otel says so (``role``, ``address``).
TOPIC = "dask-otel-absent"

#: The package whose absence a plugin survives.
PACKAGE = "dask_otel"

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def importable() -> bool:
    """Whether dask-otel can be imported here."""
    return importlib.util.find_spec(PACKAGE) is not None


class _Probe:
    """:func:`importable` for ``client.run``: pickles as the call of :func:`_probe`."""

    def __call__(self) -> bool:
        return importable()

    def __reduce__(self) -> tuple[Any, ...]:
        return _probe, ()


def _probe() -> Any:
    """:func:`importable`, where dask-otel is installed one of its own runs, which leave
    no line in the process's log (:mod:`dask_otel.plugins.own_runs`)."""
    try:
        from dask_otel.plugins import own_runs
    except ModuleNotFoundError:
        return importable
    return own_runs.register(importable)


#: Asks a process whether dask-otel is installed there (``client.run(PROBE)``).
PROBE = _Probe()


def absent_message(role: str, address: str) -> str:
    """What a client says of a process without dask-otel."""
    return f"the {role} {address} runs without dask-otel (not installed there), untraced"


class _Arrival:
    """Pickles as the call of :func:`_arrive` that makes a plugin where it lands."""

    def __init__(self, role: str, name: str, plugin: Any) -> None:
        self.role = role  #: "worker" or "nanny"
        self.name = name  #: the plugin's name in Dask
        self.pickled = dask_pickle.dumps(plugin)  #: the plugin itself, as Dask pickles it

    def __reduce__(self) -> tuple[Any, ...]:
        return _arrive, (self.role, self.name, self.pickled)


def _arrive(role: str, name: str, pickled: bytes) -> Any:
    """The plugin, or where dask-otel is not installed, one that only says so."""
    try:
        return pickle.loads(pickled)  # not Dask's loads: it logs the failure's traceback
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != PACKAGE:
            raise
    return _AbsentNanny(name) if role == "nanny" else _AbsentWorker(name)


def _said_absent(role: str, server: Any) -> None:
    """One line on this process's log, one event for the clients."""
    logging.getLogger(f"distributed.{role}").warning(
        "dask-otel is not installed in this %s: it runs untraced", role
    )
    server.log_event(TOPIC, {"role": role, "address": str(server.address)})


class _AbsentWorker(WorkerPlugin):
    """dask-otel's worker plugin where dask-otel is not installed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, worker: Any) -> None:
        _said_absent("worker", worker)


class _AbsentNanny(NannyPlugin):
    """dask-otel's Nanny plugin where dask-otel is not installed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, nanny: Any) -> None:
        _said_absent("nanny", nanny)


class _Portable:
    """Carries ``plugin`` to processes with or without dask-otel (see the module)."""

    role: str  #: "worker" or "nanny"

    def __init__(self, plugin: Any) -> None:
        self.name = plugin.name  #: the name Dask registers it under
        self.idempotent = plugin.idempotent  #: registered once, whoever asks again
        self.plugin = plugin  #: dask-otel's plugin

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (cloudpickle.dumps(_Arrival(self.role, self.name, self.plugin)),)


class PortableWorkerPlugin(_Portable, WorkerPlugin):
    """dask-otel's worker plugin, as it travels."""

    role = "worker"


class PortableNannyPlugin(_Portable, NannyPlugin):
    """dask-otel's Nanny plugin, as it travels."""

    role = "nanny"
