"""The one place dask-otel sets up the OpenTelemetry SDK.

``configure`` builds tracer, meter and logger providers from the standard ``OTEL_*``
variables (the SDK's own configurator does the reading), with OTLP as the default
exporter of all three signals and export queues sized for Dask's task rates. It names the
process after its Dask role, unless the user named it: a process started as
``dask-worker`` is ``dask-nanny`` (or ``dask-worker`` with ``--no-nanny``), a process that
later turns out to host a worker or client is renamed once, and a forked child gets a new
``service.instance.id``. Providers someone else configured are never touched.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.resources import Resource

from dask_otel import telemetry

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
    """The resource of the providers dask-otel configured, and the role it names.

    ``role`` is None until this process is known to be a scheduler, worker, nanny or
    client (e.g. a Nanny's spawned child, configured by ``opentelemetry-instrument``
    before it becomes a worker), and again after a fork.
    """

    resource: Resource
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


def _user_set(attribute: str, variable: str) -> bool:
    if os.environ.get(variable):
        return True
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.split("=", 1)[0].strip() == attribute for pair in pairs)


def _identity(role: str | None) -> dict[str, str]:
    """Resource attributes dask-otel adds unless the user set them."""
    attributes = {}
    if role and not _user_set("service.name", "OTEL_SERVICE_NAME"):
        attributes["service.name"] = SERVICE_NAMES[role]
    if not _user_set("service.instance.id", ""):
        attributes["service.instance.id"] = uuid.uuid4().hex
    return attributes


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
        attributes = {**(kwargs.pop("resource_attributes", None) or {}), **_identity(role)}
        super()._configure(resource_attributes=attributes, **kwargs)
        provider = trace.get_tracer_provider()
        resource = getattr(provider, "resource", None)
        if isinstance(resource, Resource):
            _owned = _Owned(resource, role)


def configure(role: str) -> None:
    """Make sure this process exports telemetry, named after ``role``.

    Configures the SDK when nothing did yet; names the providers dask-otel configured
    before the role was known; leaves other configurations alone.
    """
    if not telemetry.is_configured():
        DaskOtelConfigurator().configure(role=role)
    elif _owned is not None and _owned.role is None:
        _retag(role, new_instance=False)


def _retag(role: str | None, new_instance: bool) -> None:
    """Rewrite the identity of the owned resource, seen by all three providers at once.

    The SDK fixes a provider's resource at creation and has no API to change it; the
    resource object is shared, so replacing its attributes renames every signal.
    """
    assert _owned is not None
    attributes = dict(_owned.resource.attributes)
    identity = _identity(role)
    if not new_instance:
        identity.pop("service.instance.id", None)
    attributes.update(identity)
    _owned.resource._attributes = BoundedAttributes(attributes=attributes, immutable=True)
    _owned.role = role


def _after_fork_in_child() -> None:
    """A forked child is a new process: new instance id, role still to be claimed."""
    if _owned is not None:
        _retag(None, new_instance=True)


os.register_at_fork(after_in_child=_after_fork_in_child)
