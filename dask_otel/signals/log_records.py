"""What a log record carries when exported: the process's and the task's ``dask.*``
identity, the exception of Dask's "Compute Failed" as semantic attributes, and bodies
and exception text capped and redacted (:class:`DaskRecordFilter`); the SDK's own
records sparingly (:class:`Repeats`)."""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from time import monotonic
from typing import TYPE_CHECKING

from dask_otel import identity, strings

if TYPE_CHECKING:
    from opentelemetry._logs import LogRecord


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
        fields.update(identity.hosted.attributes)
        # Set while a task runs in this thread (the bridge starts with dask's import,
        # before distributed's: it must not import it).
        task = getattr(sys.modules.get("distributed.worker"), "thread_state", None)
        key = getattr(task, "key", None)
        if key is not None:
            fields["dask.task.key"] = strings.cap(strings.key_to_str(key), self.max_length)
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
        match = strings.LEADING_TYPE.match(text.strip("'\""))
        redact = strings.redaction.exception_messages
        texts = {"exception.message": text, "exception.stacktrace": str(traceback_text)}
        record.__dict__.update(
            {
                "dask.task.key": strings.cap(strings.key_to_str(key), self.max_length),
                "exception.type": match.group(1) if match else "Exception",
                **{
                    name: strings.REDACTED
                    if redact
                    else strings.cap(texts[name], strings.max_length(name, self.max_length))
                    for name in strings.EXCEPTION_TEXT
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
        if strings.redaction.log_bodies:
            body = record.msg if isinstance(record.msg, str) else strings.REDACTED
        elif (hidden := _hidden_arguments(record)) is not None:
            body = _without(record, hidden)
        elif strings.redaction.exception_messages and _quotes_exception(record):
            body = _without(record, (), quoted=True)
        elif strings.redaction.exception_messages and (record.exc_info or formatted):
            body = _message(record)
        if isinstance(body, str):
            body = strings.cap(body, strings.max_length("log.body", limit))
        for name in strings.EXCEPTION_TEXT:
            if name in attributes:
                attributes[name] = (
                    strings.REDACTED
                    if strings.redaction.exception_messages
                    else strings.cap(str(attributes[name]), strings.max_length(name, limit))
                )
        exported.body = body
        exported.attributes = attributes
        return exported


def _message(record: logging.LogRecord) -> str:
    """The record's message, without the exception a formatter would append."""
    try:
        return record.getMessage()
    except Exception:
        return str(record.msg) if isinstance(record.msg, str) else strings.REDACTED


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
            return arguments + exception if strings.redaction.exception_messages else arguments
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
        strings.REDACTED
        if i in hidden
        else f"{strings.type_name(a)}: {strings.REDACTED}"
        if quoted and isinstance(a, BaseException)
        else a
        for i, a in enumerate(args)
    )
    try:
        return str(record.msg) % shown
    except Exception:
        return strings.REDACTED
