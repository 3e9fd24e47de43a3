"""The SDK's private names that dask-otel's export path relies on, checked once.

The span writer, the span queue and the OTLP/gRPC encoding reach into the SDK where it
has no public hook: a tracer's limits and scope, the provider's list of processors, the
gRPC exporter's request building. A release of the SDK may move any of them. Before the
first use, :func:`fast_path` looks for every one; if one is missing, the export path is
the SDK's own (``start_span``, ``BatchSpanProcessor``, ``BatchLogRecordProcessor``, the
exporters' own encoding), slower but complete, and the log says so once.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class SdkName(NamedTuple):
    """One name the export path uses: ``module.owner.attribute``, where ``owner`` is a
    class or empty (a module attribute)."""

    module: str
    owner: str
    attribute: str
    #: An attribute of the class's instances, set in its ``__init__`` (looked for among
    #: the names that code sets: no instance is made, no variable read).
    on_instance: bool = False

    def __str__(self) -> str:
        return ".".join(part for part in (self.module, self.owner, self.attribute) if part)


#: Everything private the export path uses, and what uses it.
RELIED_ON: tuple[SdkName, ...] = (
    # The span writer: a tracer's limits, scope and switch; the provider's processors.
    SdkName("opentelemetry.sdk.trace", "Tracer", "_is_enabled"),
    SdkName("opentelemetry.sdk.trace", "Tracer", "_span_limits", on_instance=True),
    SdkName("opentelemetry.sdk.trace", "Tracer", "_instrumentation_scope", on_instance=True),
    SdkName(
        "opentelemetry.sdk.trace",
        "SynchronousMultiSpanProcessor",
        "_span_processors",
        on_instance=True,
    ),
    # The configurator's hook for the batch processors it makes.
    SdkName("opentelemetry.sdk._configuration", "", "_initialize_components"),
    # The OTLP/gRPC span exporter's request building (dask-otel encodes its own).
    SdkName(
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "OTLPSpanExporter",
        "_translate_data",
    ),
)


def _present(name: SdkName) -> bool:
    try:
        owner: Any = importlib.import_module(name.module)
    except ImportError:
        # An exporter that is not installed is not used either.
        return name.module.startswith("opentelemetry.exporter.")
    if name.owner:
        owner = getattr(owner, name.owner, None)
        if owner is None:
            return False
        if name.on_instance:
            init = getattr(owner.__init__, "__code__", None)
            return init is not None and name.attribute in init.co_names
    return hasattr(owner, name.attribute)


def missing() -> list[str]:
    """The names of :data:`RELIED_ON` this SDK does not have."""
    return [str(name) for name in RELIED_ON if not _present(name)]


@functools.cache
def fast_path() -> bool:
    """Whether dask-otel's own export path can run on this SDK (checked once per process);
    if not, says which names are missing, once."""
    gone = missing()
    if gone:
        logger.warning(
            "dask-otel: this OpenTelemetry SDK lacks %s; spans and log records go through "
            "the SDK's own processors and exporters (slower; nothing of a worker's queue "
            "is kept for its Nanny's post-mortem)",
            ", ".join(gone),
        )
    return not gone
