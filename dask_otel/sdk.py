"""The one place dask-otel sets up the OpenTelemetry SDK.

``configure`` builds tracer, meter and logger providers from the standard ``OTEL_*``
variables (the SDK's own configurator does the reading), with OTLP as the default
exporter of all three signals and export queues sized for Dask's task rates. It names the
process after its Dask role, unless the user named it: a process started as
``dask-worker`` is ``dask-nanny`` (or ``dask-worker`` with ``--no-nanny``), and a process
that turns out later to host a worker or client (a Nanny's child) is named then. The SDK
gives every process, forked ones included, its own ``service.instance.id``. Providers
someone else configured are never touched.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.resources import Resource

from dask_otel import telemetry

#: Directory for the ``otlp_json_file`` exporters' files (``dask-otel demo`` sets it).
FILE_EXPORT_DIR = "DASK_OTEL_FILE_EXPORT_DIR"

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
    # `task` span per task); a larger queue and batch keep up without dropping.
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2048",
    "OTEL_BLRP_MAX_QUEUE_SIZE": "16384",
    "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "1024",
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


_owned: _Owned | None = None


def infer_role(argv: list[str]) -> str | None:
    """The Dask role of a process started with ``argv``, when its command line tells."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    args = argv[1:]
    if program == "dask" and args:
        program, args = f"dask-{args[0]}", args[1:]
    if program == "dask-scheduler":
        return "scheduler"
    if program == "dask-worker":
        return "worker" if "--no-nanny" in args else "nanny"
    return None


def _service_name(role: str | None) -> dict[str, str]:
    """``service.name`` for ``role``, unless the user named the service."""
    if role is None or os.environ.get("OTEL_SERVICE_NAME"):
        return {}
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    if any(pair.split("=", 1)[0].strip() == "service.name" for pair in pairs):
        return {}
    return {"service.name": SERVICE_NAMES[role]}


class DaskOtelConfigurator(_OTelSDKConfigurator):
    """``opentelemetry_configurator`` entry point: the SDK, configured for a Dask process."""

    def _configure(self, **kwargs):  # type: ignore[no-untyped-def]
        global _owned
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return
        if telemetry.is_configured():
            return
        role = kwargs.pop("role", None) or infer_role(sys.argv)
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        attributes = {**(kwargs.pop("resource_attributes", None) or {}), **_service_name(role)}
        directory = os.environ.get(FILE_EXPORT_DIR)
        if directory:
            kwargs["exporter_args_map"] = _file_exporter_paths(directory, role)
        super()._configure(resource_attributes=attributes, **kwargs)
        providers = (
            trace.get_tracer_provider(),
            metrics.get_meter_provider(),
            _logs.get_logger_provider(),
        )
        _owned = _Owned(providers, role)


def _file_exporter_paths(directory: str, role: str | None) -> dict[type, dict[str, str]]:
    """One OTLP JSON lines file per signal and process under ``directory``.

    Used with the ``otlp_json_file`` exporters (``OTEL_TRACES_EXPORTER=otlp_json_file``
    ...), which otherwise write to standard output. Files are named
    ``<signal>-<role>-<host>-<pid>.jsonl``, the format of the collector's file exporter.
    """
    from opentelemetry.exporter.otlp.json.file._log_exporter import FileLogExporter
    from opentelemetry.exporter.otlp.json.file.metric_exporter import FileMetricExporter
    from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter

    os.makedirs(directory, exist_ok=True)
    stem = f"{role or 'process'}-{socket.gethostname()}-{os.getpid()}.jsonl"
    return {
        FileSpanExporter: {"path": os.path.join(directory, f"traces-{stem}")},
        FileMetricExporter: {"path": os.path.join(directory, f"metrics-{stem}")},
        FileLogExporter: {"path": os.path.join(directory, f"logs-{stem}")},
    }


def configure(role: str) -> None:
    """Make sure this process exports telemetry, named after ``role``.

    Configures the SDK when nothing did yet; names the providers dask-otel configured
    before the role was known; leaves other configurations alone.
    """
    if not telemetry.is_configured():
        DaskOtelConfigurator().configure(role=role)
    elif _owned is not None and _owned.role is None:
        _retag(role)


def _retag(role: str) -> None:
    """Name the owned providers' resource after ``role``.

    The SDK merges a resource into its providers' own after a fork (that is how each
    process gets its ``service.instance.id``); the same merge names the role.
    """
    assert _owned is not None
    update = Resource(_service_name(role))
    for provider in _owned.providers:
        merge = getattr(provider, "_update_resource", None)
        if merge is not None:
            merge(update)
    _owned.role = role


def _after_fork_in_child() -> None:
    """A forked child (a Nanny's worker, say) has yet to say what it is."""
    if _owned is not None:
        _owned.role = None


os.register_at_fork(after_in_child=_after_fork_in_child)
