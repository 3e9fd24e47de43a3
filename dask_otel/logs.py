"""Bridge Python logging, Dask's own loggers included, to OpenTelemetry logs.

A record made while a span is current (user code inside ``execute``) carries that span's
trace and span ids. ``distributed`` stops its loggers from propagating to the root when
it installs its own stderr handler, so the bridge also attaches to the ``distributed``
logger in that case; Dask's stderr output stays as it is. A record is exported once,
whichever loggers it passes.
"""

from __future__ import annotations

import logging

from opentelemetry._logs import LoggerProvider
from opentelemetry.instrumentation.logging.handler import LoggingHandler

_EXPORTED = "_dask_otel_exported"


class _OnceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _EXPORTED, False):
            return False
        setattr(record, _EXPORTED, True)
        return True


class DaskLoggingHandler(LoggingHandler):
    """The OpenTelemetry logging handler, exporting each record at most once."""

    def __init__(self, logger_provider: LoggerProvider) -> None:
        super().__init__(logger_provider=logger_provider)
        self.addFilter(_OnceFilter())


_handler: DaskLoggingHandler | None = None
_attached: list[logging.Logger] = []


def _has_otel_handler(logger: logging.Logger) -> bool:
    return any(type(h).__name__.endswith("LoggingHandler") for h in logger.handlers)


def install(logger_provider: LoggerProvider) -> None:
    """Attach the bridge where records would otherwise not reach an OTel handler."""
    global _handler
    if _handler is not None:
        return
    _handler = DaskLoggingHandler(logger_provider)
    root = logging.getLogger()
    distributed_logger = logging.getLogger("distributed")
    if not _has_otel_handler(root):
        root.addHandler(_handler)
        _attached.append(root)
    if not distributed_logger.propagate and not _has_otel_handler(distributed_logger):
        distributed_logger.addHandler(_handler)
        _attached.append(distributed_logger)


def uninstall() -> None:
    global _handler
    for logger in _attached:
        logger.removeHandler(_handler)  # type: ignore[arg-type]
    _attached.clear()
    _handler = None
