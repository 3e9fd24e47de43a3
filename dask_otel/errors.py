"""What an ``exception`` span event says about a task's failure, computed safely.

Dask hands exceptions around pickled, with their repr and traceback as text. Turning
them into ``exception.*`` attributes must never raise: ``str()`` of a user exception can.
With ``otel.redact.exception-messages`` the message and stack trace become
:data:`REDACTED`; the exception's type stays.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dask_otel.ids import cap

#: The class name at the start of an exception's repr, e.g. ``KeyError`` in ``KeyError('k')``.
_REPR_TYPE = re.compile(r"([A-Za-z_][\w.]*)\(")
#: What replaces a redacted exception message, stack trace or log body.
REDACTED = "[redacted]"


@dataclass
class Redaction:
    """This process's ``otel.redact.*`` settings, set whenever a component activates."""

    exception_messages: bool = False
    log_bodies: bool = False


#: The redaction in force in this process (``dask.config`` is per process too).
redaction = Redaction()


def set_redaction(settings: Any) -> None:
    """Adopt the ``otel.redact.*`` values of validated :class:`~dask_otel.config.Settings`."""
    redaction.exception_messages = bool(settings.redact_exception_messages)
    redaction.log_bodies = bool(settings.redact_log_bodies)


def type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, ``package.module.MyError`` for everything else."""
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: str() failed>"


def describe(exception: Any, text: Any) -> tuple[str, str]:
    """(``exception.type``, ``exception.message``) from what Dask recorded; never raises.

    ``exception`` may be the exception, its pickle (bytes), or a wrapper holding either
    in ``.data``; ``text`` is its repr. Only bytes the local process can unpickle are
    read (the worker's own failures, the scheduler's own ``KilledWorker``).
    """
    if not isinstance(exception, BaseException):  # an exception's own ``.data`` is not a wrapper
        try:
            exception = getattr(exception, "data", exception)
        except Exception:
            exception = None
    if isinstance(exception, (bytes, bytearray)):
        try:
            exception = pickle.loads(exception)
        except Exception:
            exception = None
    if text is not None and not isinstance(text, str):
        text = _safe_repr(text)
    text_type = _text_type(text)
    if isinstance(exception, BaseException):
        message = safe_str(exception)
        if type(exception) is Exception and text_type and message == text:
            # Dask sends ``Exception(repr(e))`` for an exception it cannot pickle: the
            # repr still names the original type, as the scheduler sees it.
            return text_type, message
        return type_name(exception), message
    if text:
        return text_type or "Exception", text
    return "Exception", "unknown error"


def _text_type(text: str | None) -> str | None:
    match = _REPR_TYPE.match(text) if text else None
    return match.group(1) if match else None


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}: repr() failed>"


def record_exception(
    span: trace.Span,
    exception: Any,
    text: str | None,
    traceback_text: str | None,
    limit: int,
    timestamp: int | None = None,
    redact: bool | None = None,
    **attributes: Any,
) -> None:
    """ERROR status, ``error.type`` and an OpenTelemetry ``exception`` event on ``span``.

    Strings are capped relative to ``limit`` (``otel.max-attribute-length``): the message
    at 4x, the stack trace at 16x. ``redact`` (default: this process's
    ``otel.redact.exception-messages``) replaces message and stack trace by
    :data:`REDACTED`.
    """
    exc_type, message = describe(exception, text)
    if redaction.exception_messages if redact is None else redact:
        message = REDACTED
        traceback_text = REDACTED if traceback_text else None
        stacktrace = REDACTED
    else:
        stacktrace = f"Traceback (most recent call last):\n{traceback_text}{exc_type}: {message}"
    event = {"exception.type": exc_type, "exception.message": cap(message, limit * 4)}
    if traceback_text:
        event["exception.stacktrace"] = cap(stacktrace, limit * 16)
    span.add_event("exception", {**event, **attributes}, timestamp=timestamp)
    span.set_attribute("error.type", exc_type)
    span.set_status(Status(StatusCode.ERROR, cap(f"{exc_type}: {message}", limit)))
