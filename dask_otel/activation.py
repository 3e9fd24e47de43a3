"""The one check every dask-otel entry point makes before it hooks into a Dask process."""

from __future__ import annotations

import logging
import os

from dask_otel.config import Settings, load_settings

logger = logging.getLogger(__name__)

#: Entry-point name, as listed in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``.
INSTRUMENTATION_NAME = "dask"


def disabled_by_environment() -> bool:
    """True when ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names ``dask``."""
    names = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    return INSTRUMENTATION_NAME in {name.strip() for name in names.split(",")}


def activate(role: str) -> Settings | None:
    """Validated settings if dask-otel should run in this ``role``, else None.

    Configures the OpenTelemetry SDK from ``OTEL_*`` variables when nothing configured it
    yet (a worker reached only through a plugin; if that fails, it says why once and
    returns None), names the process after ``role`` and bridges Python logging.
    Raises :class:`dask_otel.config.ConfigError` for invalid ``otel.*`` values.
    """
    settings = load_settings()
    if not settings.enabled or disabled_by_environment():
        return None
    from dask_otel import errors, logs, rpc, sdk, telemetry  # imports the SDK: not in hooks

    try:
        configured = sdk.configure(role)
    except Exception as e:
        sdk.configuration_failed(e)
        configured = False
    if not configured:  # a typo in an OTEL_* variable must not stop a cluster: untraced
        return None
    errors.set_redaction(settings)
    if settings.logs_enabled:
        logs.install(
            telemetry.current().logger_provider,
            settings.logs_loggers,
            settings.logs_level,
            settings.max_attribute_length,
        )
    if settings.rpc_spans:
        rpc.install(telemetry.current().tracer(), settings)
    return settings
