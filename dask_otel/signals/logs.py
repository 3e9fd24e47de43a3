"""Bridge Python logging, Dask's own loggers included, to OpenTelemetry logs.

A record made while a span is current (user code inside ``execute``, Dask's own
"Compute Failed") carries that span's trace and span ids. dask-otel's handler sits on no
logger: after Python's own handling of a record (``Logger.callHandlers``), it gets the
records that reached one of the configured loggers (``distributed`` stops its loggers
from propagating to the root when it installs its own stderr handler). So stderr stays
as it is: a handler on the root would turn off Python's last resort (warnings printed
when nothing is configured) and ``logging.basicConfig()``. Every exporting handler
(ours, or the one ``opentelemetry-instrumentation-logging`` put on the root) gets
:class:`DaskRecordFilter`: each record is exported once, stamped
with the cluster, worker and task it came from. Their translation into OpenTelemetry is
wrapped (:func:`exported`) to cap and redact what leaves the process (the Python record,
which other handlers such as Dask's stderr one format too, only gains ``dask.*`` and
``exception.*`` fields), and their ``emit`` so that a record that cannot be exported
(a bad format string, say) is reported by ``handleError`` like any handler's, never raised
into the code that logged it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections import Counter
from time import monotonic
from typing import Any

from opentelemetry._logs import LoggerProvider, LogRecord
from opentelemetry.instrumentation.logging.handler import LoggingHandler

from dask_otel.spans import errors, ids

logger = logging.getLogger(__name__)

#: Log bodies are capped at this multiple of ``otel.max-attribute-length`` (Dask's
#: "Compute Failed" body holds a stack trace); exception text as ``errors`` says.
BODY_LENGTH_FACTOR = 16


#: Identity of this process, added to every exported record (filled by the plugins).
identity: dict[str, str] = {}
_workers: set[str] = set()
#: Nannies running in this process, with the worker each supervises.
_nannies: dict[str, str | None] = {}
#: Schedulers and workers running in this process, by cluster id.
_clusters: Counter[str] = Counter()


def add_cluster(cluster_id: str) -> None:
    """A scheduler or worker of cluster ``cluster_id`` runs in this process."""
    _clusters[cluster_id] += 1
    _name_cluster()


def remove_cluster(cluster_id: str) -> None:
    """It closed: a process outliving its cluster (a client that closed its
    ``LocalCluster``) no longer names it."""
    _clusters[cluster_id] -= 1
    if _clusters[cluster_id] <= 0:
        del _clusters[cluster_id]
    _name_cluster()


def clusters() -> dict[str, int]:
    """The clusters whose schedulers and workers run in this process, with how many."""
    return dict(_clusters)


def _after_fork_in_child() -> None:
    """A forked child hosts none of its parent's schedulers and workers."""
    _clusters.clear()
    _workers.clear()
    _nannies.clear()
    _name_cluster()
    _name_worker()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _name_cluster() -> None:
    if len(_clusters) == 1:
        identity["dask.cluster.id"] = next(iter(_clusters))
    else:  # none, or several in one process: records cannot say which
        identity.pop("dask.cluster.id", None)


def add_worker(address: str) -> None:
    """Name the worker on this process's records (unless several share the process)."""
    _workers.add(address)
    _name_worker()


def remove_worker(address: str) -> None:
    _workers.discard(address)
    _name_worker()


def add_nanny(address: str, worker: str | None) -> None:
    """Name the Nanny and the worker it supervises on this process's records (a Nanny's
    records are about its worker), unless several share the process."""
    _nannies[address] = worker
    _name_worker()


def remove_nanny(address: str) -> None:
    _nannies.pop(address, None)
    _name_worker()


def _name_worker() -> None:
    _name("dask.worker.address", _workers or {w for w in _nannies.values() if w})
    _name("dask.nanny.address", set(_nannies))


def _name(attribute: str, values: set[str]) -> None:
    if len(values) == 1:
        identity[attribute] = next(iter(values))
    else:
        identity.pop(attribute, None)


class Repeats:
    """The OpenTelemetry SDK's own records (``opentelemetry.*`` loggers), each message at
    most once per :attr:`WINDOW` seconds, carrying ``dask_otel.log.repeated``: how many
    were held back since. The SDK logs once per occurrence ("Attributes dict is full" for
    each attribute over the limit: 1,552 records for 4 tasks that set 2,000 each), which
    would flood the export it warns about. Only the exported copy is held back."""

    #: Seconds between two exported records of one message.
    WINDOW = 60.0
    #: Messages remembered; past that (messages made with f-strings), all are forgotten.
    MAX_MESSAGES = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (logger, message template) -> (when it was last exported, held back since).
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def admit(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = monotonic()
        with self._lock:
            last, held = self._seen.get(key, (-self.WINDOW, 0))
            if now - last < self.WINDOW:
                self._seen[key] = (last, held + 1)
                return False
            if len(self._seen) >= self.MAX_MESSAGES:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            record.__dict__["dask_otel.log.repeated"] = held
        return True


class DaskRecordFilter(logging.Filter):
    """Export a record once, with ``dask.*`` identity and, for task failures, the error;
    the SDK's own records sparingly (:class:`Repeats`)."""

    def __init__(self, max_length: int = 256) -> None:
        super().__init__()
        self.max_length = max_length
        self._repeats = Repeats()
        # Every handler a record reaches runs in one callHandlers on the emitting thread:
        # remembering the last record per thread is enough to export it once. Weakly: a
        # record's traceback holds its frames' locals (a task's data) until it is gone.
        self._last = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        last = getattr(self._last, "record", None)
        if last is not None and last() is record:
            return False
        self._last.record = weakref.ref(record)
        if record.name.startswith("opentelemetry") and not self._repeats.admit(record):
            return False
        fields = record.__dict__
        fields.update(identity)
        # Set while a task runs in this thread (the bridge starts with dask's import,
        # before distributed's: it must not import it).
        task = getattr(sys.modules.get("distributed.worker"), "thread_state", None)
        key = getattr(task, "key", None)
        if key is not None:
            fields["dask.task.key"] = ids.cap(ids.key_to_str(key), self.max_length)
            worker = getattr(task, "execution_state", {}).get("worker")
            if worker is not None:
                fields["dask.worker.address"] = worker.address
        if _is_compute_failed(record):
            self._describe_failure(record)
        return True

    def _describe_failure(self, record: logging.LogRecord) -> None:
        """Dask's "Compute Failed" record, with the exception as semantic attributes."""
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 5:
            return
        key, _, _, exception_text, traceback_text = args[:5]
        text = str(exception_text)
        match = errors.LEADING_TYPE.match(text.strip("'\""))
        redact = errors.redaction.exception_messages
        texts = {"exception.message": text, "exception.stacktrace": str(traceback_text)}
        record.__dict__.update(
            {
                "dask.task.key": ids.cap(ids.key_to_str(key), self.max_length),
                "exception.type": match.group(1) if match else "Exception",
                **{
                    name: errors.REDACTED if redact else ids.cap(texts[name], self.max_length * n)
                    for name, n in errors.EXCEPTION_TEXT_FACTORS.items()
                },
            }
        )

    def exported(
        self, record: logging.LogRecord, exported: LogRecord, formatted: bool
    ) -> LogRecord:
        """``exported`` (the handler's translation of ``record``), capped and redacted.

        ``formatted``: the handler formatted the body (a formatter may append the stack
        trace). Only the OpenTelemetry record changes, never ``record``.
        """
        limit = self.max_length
        body = exported.body
        attributes = dict(exported.attributes or {})
        if errors.redaction.log_bodies:
            body = record.msg if isinstance(record.msg, str) else errors.REDACTED
        elif (hidden := _hidden_arguments(record)) is not None:
            body = _without(record, hidden)
        elif errors.redaction.exception_messages and _quotes_exception(record):
            body = _without(record, (), quoted=True)
        elif errors.redaction.exception_messages and (record.exc_info or formatted):
            body = _message(record)
        if isinstance(body, str):
            body = ids.cap(body, limit * BODY_LENGTH_FACTOR)
        for name, factor in errors.EXCEPTION_TEXT_FACTORS.items():
            if name in attributes:
                attributes[name] = (
                    errors.REDACTED
                    if errors.redaction.exception_messages
                    else ids.cap(str(attributes[name]), limit * factor)
                )
        exported.body = body
        exported.attributes = attributes
        return exported


def _message(record: logging.LogRecord) -> str:
    """The record's message, without the exception a formatter would append."""
    try:
        return record.getMessage()
    except Exception:
        return str(record.msg) if isinstance(record.msg, str) else errors.REDACTED


#: Dask's records that print what it ran, by logger and message start: the arguments (by
#: position) that print a task (``Compute Failed``: its ``Task:`` line; for a graph of
#: literal values, ``client.get`` or ``DataNode``, with its arguments) or a function's
#: arguments (``Run Failed``, from ``client.run`` and ``run_on_scheduler``), and those
#: that print its exception.
_ARGUMENT_RECORDS: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {
    ("distributed.worker", "Compute Failed"): ((2,), (3, 4)),
    ("distributed.worker", "Run Failed"): ((1, 2), ()),
}


def _hidden_arguments(record: logging.LogRecord) -> tuple[int, ...] | None:
    """Positions of ``record``'s arguments never exported (more with exception messages
    redacted), or None for a record that prints nothing Dask ran."""
    if not isinstance(record.msg, str):
        return None
    for (name, start), (arguments, exception) in _ARGUMENT_RECORDS.items():
        if record.name == name and record.msg.startswith(start):
            return arguments + exception if errors.redaction.exception_messages else arguments
    return None


def _is_compute_failed(record: logging.LogRecord) -> bool:
    return record.name == "distributed.worker" and str(record.msg).startswith("Compute Failed")


def _quotes_exception(record: logging.LogRecord) -> bool:
    """Whether an argument of ``record`` is an exception (``"retrying: %s", e``)."""
    args = record.args
    return isinstance(args, tuple) and any(isinstance(a, BaseException) for a in args)


def _without(record: logging.LogRecord, hidden: tuple[int, ...], quoted: bool = False) -> str:
    """``record``'s message with the arguments at ``hidden`` printed as ``[redacted]``,
    and with ``quoted`` exceptions as their type only (``ValueError: [redacted]``); without
    the exception a formatter would append."""
    args = record.args if isinstance(record.args, tuple) else ()
    shown = tuple(
        errors.REDACTED
        if i in hidden
        else f"{errors.type_name(a)}: {errors.REDACTED}"
        if quoted and isinstance(a, BaseException)
        else a
        for i, a in enumerate(args)
    )
    try:
        return str(record.msg) % shown
    except Exception:
        return errors.REDACTED


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
            return _filter.exported(record, translate(record), handler.formatter is not None)

        _replace(handler, "_translate", _translate)


def _guard_emit(handler: logging.Handler) -> None:
    """Make ``handler`` report its own failures (``handleError``, as the standard library's
    handlers do) instead of raising them into the code that logged: the OpenTelemetry
    handler lets an error in ``getMessage`` escape, which would fail a task that logs."""
    emit = handler.emit
    if not _wrapped(emit):

        def _emit(record: logging.LogRecord) -> None:
            try:
                emit(record)
            except Exception:
                handler.handleError(record)

        _replace(handler, "emit", _emit)


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


#: What this process exports, once :func:`install` ran.
_export: _Export | None = None
#: ``Logger.callHandlers`` as :func:`install` found it.
_call_handlers_before = logging.Logger.callHandlers
#: Other OpenTelemetry handlers that dask-otel's filter and wrappers were added to.
_attached: list[logging.Handler] = []
_filter = DaskRecordFilter()


def _call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
    """``Logger.callHandlers``: Python's own handling first (what plain Python prints,
    it still prints), then the export."""
    _call_handlers_before(self, record)
    export = _export
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
    global _export, _call_handlers_before
    if max_length is not None:
        _filter.max_length = max_length
    if _export is not None:
        return
    handler = LoggingHandler(level=level, logger_provider=logger_provider)
    targets = frozenset(logging.getLogger(name or None) for name in loggers)
    # Another OTel handler on the root (the logging instrumentation's) exports propagated
    # records too: stamp them, and keep them from being exported twice.
    others = [h for h in map(_otel_handler, {logging.getLogger(), *targets}) if h is not None]
    for exporting in (handler, *others):
        exporting.addFilter(_filter)
        _wrap_translation(exporting)
        _guard_emit(exporting)
    _attached.extend(others)
    _export = _Export(handler, targets)
    if logging.Logger.callHandlers is not _call_handlers:
        _call_handlers_before = logging.Logger.callHandlers
        logging.Logger.callHandlers = _call_handlers  # type: ignore[method-assign]


def uninstall() -> None:
    global _export
    _export = None
    if logging.Logger.callHandlers is _call_handlers:
        logging.Logger.callHandlers = _call_handlers_before  # type: ignore[method-assign]
    for handler in _attached:
        handler.removeFilter(_filter)
        _unwrap(handler)
    _attached.clear()
