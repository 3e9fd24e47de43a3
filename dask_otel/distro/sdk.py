"""The one place dask-otel sets up the OpenTelemetry SDK.

``configure`` builds tracer, meter and logger providers from the standard ``OTEL_*``
variables (the SDK's own configurator does the reading), with OTLP as the default
exporter of all three signals, export queues of its own, sized for Dask's task rates and
bounded in memory, and export batches that fit a collector's 4 MiB message limit; the
spans and log records its processors lose anyway are counted
(``dask_otel.exporter.dropped``), said once in the log, and at exit said once on stderr.
Its flushes and its exit wait no longer than the collector answers, and its threads run
only while there is something to export (none in a process that never uses Dask, none left
by a closed cluster). It names the process
after its Dask role, unless the user named it: a process started as ``dask-worker`` is
``dask-nanny`` (or ``dask-worker`` with ``--no-nanny``), and a process that turns out later
to host a worker or client (a Nanny's child) is named then. The SDK gives every process,
forked ones included, its own ``service.instance.id``. Providers someone else configured
are never touched.

The parts it puts together are modules of their own: the export queues
(:mod:`dask_otel.export.queues`) fed by dask-otel's processors
(:mod:`dask_otel.export.processors`), spans queued as tuples
(:mod:`dask_otel.export.queued_spans`) or written straight as tuples
(:mod:`dask_otel.export.span_writer`), what is lost (:mod:`dask_otel.export.drops`), and the
flight recorder's copy of the queues (:mod:`dask_otel.export.recorder_copy`), and metric readers
that tick only while metrics are wanted, their exports watched as the queues' are
(:mod:`dask_otel.export.metric_readers`).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.resources import Resource

from dask_otel import runtime
from dask_otel.environment import FILE_EXPORT_DIR
from dask_otel.export.drops import NOUNS, losses, register_dropped_counter
from dask_otel.export.metric_readers import (
    metric_exporters,
    note_foreign_meters,
    readers_on_demand,
    watch_metric_exporters,
)
from dask_otel.export.processors import counting_processors
from dask_otel.export.processors import span_processor as span_processor  # as README says
from dask_otel.export.queues import export_queues, unexported
from dask_otel.runtime import say_once
from dask_otel.runtime_state import ProcessState

logger = logging.getLogger(__name__)


#: Longest the exit waits for its exporters to stop (their gRPC channels to close).
STOP_TIMEOUT = 1.0

SERVICE_NAMES = {
    "scheduler": "dask-scheduler",
    "worker": "dask-worker",
    "nanny": "dask-nanny",
    "client": "dask-client",
}

#: Defaults applied with ``os.environ.setdefault``, as opentelemetry-distro does: the
#: user's own values win, and child processes (Nanny workers) see the same settings.
ENV_DEFAULTS = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_LOGS_EXPORTER": "otlp",
    # The SDK's 2048-span queue overflows at Dask's task rates (a scheduler emits one
    # `task` span per task): a larger queue absorbs bursts without dropping.
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BLRP_MAX_QUEUE_SIZE": "16384",
    # One export request must stay under the collector's (and gRPC's) 4 MiB message
    # limit, or the whole batch is retried until the timeout and lost. Spans of failed
    # tasks carry messages and stacks (up to ~6 kB at the default attribute caps):
    # 2048 of them made 5 MiB requests; 512 (the SDK's default batch) stays under 4 MiB.
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512",
    "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "512",
}


@dataclass
class _Owned:
    """The providers dask-otel configured, and the Dask role their resource names.

    ``role`` is None until this process is known to be a scheduler, worker, nanny or
    client (e.g. a Nanny's spawned child, configured by ``opentelemetry-instrument``
    before it becomes a worker), and again in a forked child.
    """

    providers: tuple[object, ...]
    role: str | None


class Configuration(ProcessState):
    """What configuring the SDK from ``OTEL_*`` did in this process."""

    def __init__(self) -> None:
        #: The providers dask-otel configured, if it did.
        self.owned: _Owned | None = None
        #: Why configuring failed, if it did: the process runs untraced, and no later entry
        #: point (a client's every submission) tries again.
        self.failure: Exception | None = None

    def forget_parent(self) -> None:
        """A forked child (a Nanny's worker, say) has yet to say what it is."""
        if self.owned is not None:
            self.owned.role = None


#: The one per process.
configuration = runtime.own(Configuration())


def infer_role(argv: list[str]) -> str | None:
    """The Dask role of a process started with ``argv``, when its command line tells."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program == "__main__.py" and os.path.basename(os.path.dirname(argv[0])) == "dask":
        program = "dask"  # python -m dask ...
    args = argv[1:]
    if program == "dask" and args:
        program, args = f"dask-{args[0]}", args[1:]
    if program == "dask-scheduler":
        return "scheduler"
    if program == "dask-worker":
        return "worker" if "--no-nanny" in args else "nanny"
    return None


def _role_at_start(argv: list[str]) -> str | None:
    """The role a process is named after from its first signal: its Dask command's, else
    ``client`` (a user's script or notebook: one ``service.name`` for its own spans and
    its computations). None only for a multiprocessing child (a Nanny's worker), whose
    role is known once Dask runs in it."""
    role = infer_role(argv)
    if role is None and "--multiprocessing-fork" not in argv and not forked_from_helper():
        return "client"
    return role


def _user_set(attribute: str) -> bool:
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.split("=", 1)[0].strip() == attribute for pair in pairs)


def _service_name(role: str | None) -> dict[str, str]:
    """``service.name`` for ``role``, unless the user named the service."""
    if role is None or os.environ.get("OTEL_SERVICE_NAME") or _user_set("service.name"):
        return {}
    return {"service.name": SERVICE_NAMES[role]}


def _host_name() -> dict[str, str]:
    """``host.name``, unless the user set it: what tells backends which spans come from
    one machine (Jaeger corrects clock skew only between hosts)."""
    return {} if _user_set("host.name") else {"host.name": socket.gethostname()}


class DaskOtelConfigurator(_OTelSDKConfigurator):
    """``opentelemetry_configurator`` entry point: the SDK, configured for a Dask process."""

    def _configure(self, **kwargs):  # type: ignore[no-untyped-def]
        # Before the instrumentors load, SDK disabled or not: the logging instrumentation
        # (installed with dask-otel) would put its handler on the root logger, which turns
        # off what Python prints when nothing is configured (its last resort, and the
        # basicConfig of logging.warning()). dask-otel exports those records itself
        # (dask_otel.logs), from no logger's handlers; the user's "true" still wins.
        os.environ.setdefault("OTEL_PYTHON_LOG_AUTO_INSTRUMENTATION", "false")
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return
        if _multiprocessing_helper():
            return
        if runtime.is_configured():
            return
        role = kwargs.pop("role", None) or _role_at_start(sys.argv)
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        attributes = {
            **(kwargs.pop("resource_attributes", None) or {}),
            **_host_name(),
            **_service_name(role),
        }
        for name, factory in counting_processors().items():
            kwargs.setdefault(name, factory)
        try:
            _check_sampler()
            directory = os.environ.get(FILE_EXPORT_DIR)
            if directory:
                kwargs["exporter_args_map"] = _file_exporter_streams(directory)
            with readers_on_demand():
                super()._configure(resource_attributes=attributes, **kwargs)
        except Exception as e:
            # Raised here, opentelemetry-instrument would print it and load no
            # instrumentor at all: say what is wrong once, and let the process run.
            configuration.failure = e
            configuration_failed(e)
            return
        register_dropped_counter()
        watch_metric_exporters(metrics.get_meter_provider())
        note_foreign_meters(metrics.get_meter_provider())
        providers = (
            trace.get_tracer_provider(),
            metrics.get_meter_provider(),
            _logs.get_logger_provider(),
        )
        configuration.owned = _Owned(providers, role)
        runtime.at_exit("export", _shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """Shut the owned providers down at exit within ``otel.flush-timeout``, then say on
    stderr what this process could not export.

    Replaces the SDK's own atexit shutdown, which waits up to 30 s per batch processor
    (and again for the metric reader) while the exporters retry against an unreachable
    or stalled collector: a SIGTERM'd scheduler would take most of a minute to exit.
    Here the wait also ends once the collector has answered nothing for a moment
    (``runtime.health``): at once, nearly, when the last export had already failed.
    """
    owned = configuration.owned
    if owned is None:
        return
    for provider in owned.providers:
        atexit.unregister(provider.shutdown)  # the SDK's handler; a second call only warns
    settings = runtime.settings_if_dask_imported()
    timeout = 5.0 if settings is None else settings.flush_timeout  # 5 s: its default
    if runtime.exit_limit is not None:
        timeout = min(timeout, runtime.exit_limit)
    runtime.shutdown(runtime.Providers(*owned.providers), timeout)  # type: ignore[arg-type]
    # If the shutdown gave up: no request left open for the interpreter's exit to wait on.
    # In a thread, waited for boundedly: a channel that a fork split may never close.
    stopping = threading.Thread(target=_stop_exporters, name="dask-otel-stop", daemon=True)
    try:
        stopping.start()
    except RuntimeError:  # no new thread this late (an interpreter that refuses): stop here
        _stop_exporters()
    else:
        stopping.join(STOP_TIMEOUT)
    _say_loss()
    # Said: the exporters' threads, which may still end a batch in failure, say no more.
    losses.said.update(NOUNS)


def _stop_exporters() -> None:
    for stoppable in [*export_queues, *metric_exporters]:
        stoppable.stop()


def _say_loss() -> None:
    """Say on stderr how many spans and log records this process did not
    export: lost on the way, and still queued (at exit). Nothing if all went out."""
    lost, dropped_by_reason = unexported()
    for (signal, _), count in dropped_by_reason.items():
        lost[signal] += count
    queues = list(export_queues)
    endpoints = (getattr(queue.exporter.exporter, "_endpoint", None) for queue in queues)
    destination = next((endpoint for endpoint in endpoints if endpoint), "its exporter")
    if not sum(lost.values()):
        return
    counts = ", ".join(f"{lost[signal]} {noun}" for signal, noun in NOUNS.items() if lost[signal])
    if runtime.health.failing():
        say_once(f"collector unreachable at {destination}: {counts} not exported")
    else:
        say_once(f"{counts} not exported to {destination} (see the log)")


def _file_exporter_streams(directory: str) -> dict[type, dict[str, Any]]:
    """One OTLP JSON lines file per signal and process under ``directory``.

    Used with the ``otlp_json_file`` exporters (``OTEL_TRACES_EXPORTER=otlp_json_file``
    ...), which otherwise write to standard output. Files are named
    ``<signal>-<role>-<host>-<pid>.jsonl`` (see :class:`_RoleFile`), in the format of
    the collector's file exporter.
    """
    from opentelemetry.exporter.otlp.json.file._log_exporter import FileLogExporter
    from opentelemetry.exporter.otlp.json.file.metric_exporter import FileMetricExporter
    from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter

    return {
        FileSpanExporter: {"stream": _RoleFile(directory, "traces")},
        FileMetricExporter: {"stream": _RoleFile(directory, "metrics")},
        FileLogExporter: {"stream": _RoleFile(directory, "logs")},
    }


class _RoleFile:
    """The stream an ``otlp_json_file`` exporter writes to: a file named after the
    process's Dask role (``traces-worker-<host>-<pid>.jsonl``).

    Opened at the first line, so a process that exports nothing leaves no file; renamed
    when the process learns its role after that (a Nanny's worker process is configured
    by ``opentelemetry-instrument`` before it is a worker); opened anew in a forked
    child. A process that never has a Dask role is named after its program.
    """

    def __init__(self, directory: str, signal: str) -> None:
        self._directory = directory
        self._signal = signal
        self._file: Any = None
        self._path = ""
        self._pid = 0
        #: What the exporter checks before it writes.
        self.closed = False

    def _wanted(self) -> str:
        owned = configuration.owned
        role = owned.role if owned is not None and owned.role else _program()
        name = f"{self._signal}-{role}-{socket.gethostname()}-{os.getpid()}.jsonl"
        return os.path.join(self._directory, name)

    def write(self, text: str) -> int:
        path = self._wanted()
        if self._file is None or self._pid != os.getpid():
            os.makedirs(self._directory, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (the process's life)
            self._path, self._pid = path, os.getpid()
        elif path != self._path:
            os.replace(self._path, path)  # the process learnt its role
            self._path = path
        return int(self._file.write(text))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()


def _program() -> str:
    """A process's name when it has no Dask role: its script's, or ``python``."""
    name = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name).strip("_") or "python"


def _multiprocessing_helper() -> bool:
    """Python's own helper processes (the resource tracker, the forkserver) start from a
    Dask process's environment (``opentelemetry-instrument``'s sitecustomize included)
    but run no Dask code: they configure nothing and export nothing. (A worker forked
    from the forkserver shares its command line, not its pid.)"""
    return os.getpid() == _HELPER_PID


def forked_from_helper() -> bool:
    """Whether this process was forked from one of those helpers (a worker started by
    the forkserver): nothing configured its SDK at start."""
    return _HELPER_PID is not None and os.getpid() != _HELPER_PID


def _helper_pid() -> int | None:
    """The helper's pid, in the helper or in a process forked from it, which shares its
    command line (and imports dask-otel after the fork, as the worker's plugin is
    unpickled)."""
    argv = getattr(sys, "orig_argv", [])
    code = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
    helper = "multiprocessing.resource_tracker" in code or "multiprocessing.forkserver" in code
    if not helper:
        return None
    return os.getppid() if _served_by_forkserver() else os.getpid()


def _served_by_forkserver() -> bool:
    """Whether this process is one the forkserver forked: it set the descriptor that
    tells its children whether it is alive (``None`` in the forkserver itself)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_alive_fd", None) is not None


#: This process's pid if it is one of Python's multiprocessing helpers.
_HELPER_PID = _helper_pid()


#: The entry-point group of the SDK's samplers (its own and other packages').
_SAMPLERS = "opentelemetry_traces_sampler"
#: The variable that chooses the component of each entry-point group the SDK loads.
_COMPONENT_VARIABLES = {
    "opentelemetry_traces_exporter": "OTEL_TRACES_EXPORTER",
    "opentelemetry_metrics_exporter": "OTEL_METRICS_EXPORTER",
    "opentelemetry_logs_exporter": "OTEL_LOGS_EXPORTER",
    "opentelemetry_id_generator": "OTEL_PYTHON_ID_GENERATOR",
    _SAMPLERS: "OTEL_TRACES_SAMPLER",
}
_UNKNOWN_COMPONENT = re.compile(r"Requested component '(.*)' not found in entry point '(.*)'")


class UnknownComponent(LookupError):
    """An ``OTEL_*`` variable names a component (``name``) that no installed package
    provides in its entry-point ``group``."""

    def __init__(self, group: str, name: str) -> None:
        super().__init__(group, name)
        self.group = group
        self.name = name


def _check_sampler() -> None:
    """Raise :class:`UnknownComponent` for an ``OTEL_TRACES_SAMPLER`` that names no
    sampler: the SDK would trace everything with its default instead, warning at every
    tracer provider it makes, where an unknown exporter stops it."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip()
    known = {entry.name for entry in entry_points(group=_SAMPLERS)}
    if name and name not in known and name.lower() not in known:
        raise UnknownComponent(_SAMPLERS, name)


def configuration_failed(error: Exception) -> None:
    """Say once, on one line of stderr, that a bad ``OTEL_*`` setting keeps this process
    from exporting: the variable, its value and what is installed, when the error tells
    (an exporter or sampler name that no installed package provides)."""
    if not isinstance(error, UnknownComponent):
        unknown = _UNKNOWN_COMPONENT.search(str(error))
        if unknown is not None:
            error = UnknownComponent(unknown.group(2), unknown.group(1))
    if isinstance(error, UnknownComponent) and error.group in _COMPONENT_VARIABLES:
        group = error.group
        installed = {entry.name for entry in entry_points(group=group)}
        exporter = group.endswith("_exporter")
        if exporter:
            installed.add("otlp")  # the SDK's own name for OTLP over OTEL_EXPORTER_OTLP_PROTOCOL
        problem = (
            f"{_COMPONENT_VARIABLES[group]}={error.name} names nothing installed "
            f"(installed: {', '.join(sorted(installed))}{'; or none' if exporter else ''})"
        )
    else:
        problem = f"{type(error).__name__}: {error}"
    say_once(f"cannot configure OpenTelemetry: {problem}. Telemetry is off in this process.")


def configure(role: str) -> bool:
    """Make sure this process exports telemetry, named after ``role``; False if it cannot
    (configuring from ``OTEL_*`` failed, now or before: said once, not tried again).

    Configures the SDK when nothing did yet; names the providers dask-otel configured
    before the role was known; leaves other configurations alone.
    """
    if not runtime.is_configured():
        if configuration.failure is None:
            DaskOtelConfigurator().configure(role=role)
        return configuration.failure is None
    name_process(role)
    return True  # by dask-otel, or by the user (after a failure of ours, too)


def name_process(role: str) -> None:
    """Name the providers dask-otel configured before the role was known (a Nanny's
    child, say) after ``role``; anything else stays as it is."""
    owned = configuration.owned
    if owned is not None and owned.role is None:
        _retag(owned, role)


def owns_providers() -> bool:
    """Whether dask-otel configured this process's providers (not the user, nor nobody)."""
    return configuration.owned is not None


def _retag(owned: _Owned, role: str) -> None:
    """Name the owned providers' resource after ``role``.

    The SDK merges a resource into its providers' own after a fork (that is how each
    process gets its ``service.instance.id``); the same merge names the role.
    """
    update = Resource(_service_name(role))
    for provider in owned.providers:
        merge = getattr(provider, "_update_resource", None)
        if merge is not None:
            merge(update)
    owned.role = role
