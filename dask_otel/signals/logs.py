"""Bridge Python logging, Dask's own loggers included, to OpenTelemetry logs.

A record made while a span is current (user code inside ``execute``, Dask's own
"Compute Failed") carries that span's trace and span ids. dask-otel's handler sits on no
logger: after Python's own handling of a record (``Logger.callHandlers``), it gets the
records that reached one of the configured loggers (``distributed`` stops its loggers
from propagating to the root when it installs its own stderr handler). So stderr stays
as it is: a handler on the root would turn off Python's last resort (warnings printed
when nothing is configured) and ``logging.basicConfig()``. Every exporting handler
(ours, or the one ``opentelemetry-instrumentation-logging`` put on the root) gets
:class:`~dask_otel.signals.log_records.DaskRecordFilter`: each record is exported once,
stamped with the cluster, worker and task it came from. Their translation into
OpenTelemetry is wrapped (``DaskRecordFilter.exported``) to cap and redact what leaves the
process (the Python record, which other handlers such as Dask's stderr one format too,
only gains ``dask.*`` and ``exception.*`` fields), and their ``emit`` so that a record
that cannot be exported (a bad format string, say) is reported by ``handleError`` like
any handler's, never raised into the code that logged it.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry._logs import LoggerProvider
from opentelemetry.instrumentation.logging.handler import LoggingHandler

from dask_otel import runtime
from dask_otel.runtime_state import ProcessState
from dask_otel.signals.log_records import DaskRecordFilter
from dask_otel.strings import safe_repr

logger = logging.getLogger(__name__)


def _wrap_translation(handler: logging.Handler) -> None:
    """Route ``handler``'s OpenTelemetry records through :meth:`DaskRecordFilter.exported`.

    The wrapper is an attribute of this handler object only (undone by :func:`uninstall`);
    the logging instrumentation's root handler is wrapped as well as dask-otel's own.
    """
    translate = getattr(handler, "_translate", None)
    if translate is None:
        logger.warning(
            "dask-otel: cannot cap or redact the records exported by %s (otel.redact.*, "
            "and the task in Dask's Compute Failed record, which may show its arguments)",
            type(handler).__name__,
        )
        return
    if not _wrapped(translate):

        def _translate(record: logging.LogRecord) -> Any:
            return log_export.filter.exported(
                record, translate(record), handler.formatter is not None
            )

        _replace(handler, "_translate", _translate)


def _guard_emit(handler: logging.Handler) -> None:
    """Make ``handler`` report its own failures (``handleError``, as the standard library's
    handlers do) instead of raising them into the code that logged: the OpenTelemetry
    handler lets an error in ``getMessage`` escape, which would fail a task that logs.

    A record whose message cannot be formatted is no failure of this handler's: the
    handlers that format it report it, as they do without dask-otel (a second report
    would be dask-otel's alone), and it is exported with its message unformatted."""
    emit = handler.emit
    if not _wrapped(emit):

        def _emit(record: logging.LogRecord) -> None:
            try:
                emit(record)
                return
            except Exception:
                if _formats(record):
                    handler.handleError(record)
                    return
            try:
                emit(_unformatted(record))
            except Exception:
                handler.handleError(record)

        _replace(handler, "emit", _emit)


def _formats(record: logging.LogRecord) -> bool:
    try:
        record.getMessage()
    except Exception:
        return False
    return True


def _unformatted(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message is its format string and arguments, as
    Python's report of the error shows them."""
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg = f"{safe_repr(record.msg)} % {safe_repr(record.args)}"
    copy.args = None
    return copy


def _wrapped(method: Any) -> bool:
    return hasattr(method, "_dask_otel_previous")


def _replace(handler: logging.Handler, name: str, wrapper: Any) -> None:
    """``wrapper`` as ``handler.<name>``, on this handler object only, remembering what
    the object had there (another library's wrapper, or nothing: the class's method)."""
    wrapper._dask_otel_previous = handler.__dict__.get(name)
    setattr(handler, name, wrapper)


def _unwrap(handler: logging.Handler) -> None:
    """Undo :func:`_wrap_translation` and :func:`_guard_emit`."""
    for name in ("_translate", "emit"):
        current = handler.__dict__.get(name)
        if _wrapped(current):
            previous = current._dask_otel_previous
            if previous is None:
                del handler.__dict__[name]
            else:
                handler.__dict__[name] = previous


class _Export:
    """Hands the records that reach one of ``loggers`` to ``handler`` (dask-otel's
    exporting handler), which is no logger's handler: see :func:`_call_handlers`."""

    def __init__(self, handler: logging.Handler, loggers: frozenset[logging.Logger]) -> None:
        self.handler = handler
        self.loggers = loggers

    def __call__(self, logger: logging.Logger | None, record: logging.LogRecord) -> None:
        if record.levelno < self.handler.level:
            return
        while logger is not None:  # the way Python hands a record up to the loggers' handlers
            if logger in self.loggers:
                try:
                    self.handler.handle(record)
                except Exception:  # a filter's failure, say: never the code that logged
                    self.handler.handleError(record)
                return
            logger = logger.parent if logger.propagate else None


class LogExport(ProcessState):
    """What this process exports of its log records, and how Python's handling was
    extended to do it."""

    def __init__(self) -> None:
        #: The export, once :func:`install` ran.
        self.export: _Export | None = None
        #: ``Logger.callHandlers`` as :func:`install` found it.
        self.call_handlers_before = logging.Logger.callHandlers
        #: Other OpenTelemetry handlers that dask-otel's filter and wrappers were added to.
        self.attached: list[logging.Handler] = []
        #: What stamps and caps the records exported.
        self.filter = DaskRecordFilter()


#: The one per process.
log_export = runtime.own(LogExport())


def _call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
    """``Logger.callHandlers``: Python's own handling first (what plain Python prints,
    it still prints), then the export."""
    log_export.call_handlers_before(self, record)
    export = log_export.export
    if export is not None:
        export(self, record)


def _otel_handler(logger: logging.Logger) -> logging.Handler | None:
    for handler in logger.handlers:
        if type(handler).__name__.endswith("LoggingHandler"):
            return handler
    return None


def install(
    logger_provider: LoggerProvider,
    loggers: tuple[str, ...],
    level: int,
    max_length: int | None = None,
) -> None:
    """Export records of ``loggers`` ("" is the root) at ``level`` and above.

    ``max_length`` (``otel.max-attribute-length``) caps bodies and exception text; a
    later call (another component activating) updates it.
    """
    state = log_export
    if max_length is not None:
        state.filter.max_length = max_length
    if state.export is not None:
        return
    handler = LoggingHandler(level=level, logger_provider=logger_provider)
    targets = frozenset(logging.getLogger(name or None) for name in loggers)
    # Another OTel handler on the root (the logging instrumentation's) exports propagated
    # records too: stamp them, and keep them from being exported twice.
    others = [h for h in map(_otel_handler, {logging.getLogger(), *targets}) if h is not None]
    for exporting in (handler, *others):
        exporting.addFilter(state.filter)
        _wrap_translation(exporting)
        _guard_emit(exporting)
    state.attached.extend(others)
    state.export = _Export(handler, targets)
    if logging.Logger.callHandlers is not _call_handlers:
        state.call_handlers_before = logging.Logger.callHandlers
        logging.Logger.callHandlers = _call_handlers  # type: ignore[method-assign]


def uninstall() -> None:
    state = log_export
    state.export = None
    if logging.Logger.callHandlers is _call_handlers:
        logging.Logger.callHandlers = state.call_handlers_before  # type: ignore[method-assign]
    for handler in state.attached:
        handler.removeFilter(state.filter)
        _unwrap(handler)
    state.attached.clear()
