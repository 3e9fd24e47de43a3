"""What an ``exception`` span event says about a task's failure, computed safely.

Dask hands exceptions around pickled, with their repr and traceback as text. Turning
them into ``exception.*`` attributes must never raise: ``str()`` of a user exception can.
"""

from __future__ import annotations

import pickle
import re
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dask_otel.ids import cap

#: The class name at the start of an exception's repr, e.g. ``KeyError`` in ``KeyError('k')``.
_REPR_TYPE = re.compile(r"([A-Za-z_][\w.]*)\(")


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


def describe(exception: Any, text: str | None) -> tuple[str, str]:
    """(``exception.type``, ``exception.message``) from what Dask recorded.

    ``exception`` may be the exception, its pickle (bytes), or a wrapper holding either
    in ``.data``; ``text`` is its repr. Only bytes the local process can unpickle are
    read (the worker's own failures, the scheduler's own ``KilledWorker``).
    """
    exception = getattr(exception, "data", exception)
    if isinstance(exception, bytes):
        try:
            exception = pickle.loads(exception)
        except Exception:
            exception = None
    if isinstance(exception, BaseException):
        return type_name(exception), safe_str(exception)
    if text:
        match = _REPR_TYPE.match(text)
        return (match.group(1) if match else "Exception"), text
    return "Exception", "unknown error"


def record_exception(
    span: trace.Span,
    exception: Any,
    text: str | None,
    traceback_text: str | None,
    limit: int,
    timestamp: int | None = None,
    **attributes: Any,
) -> None:
    """ERROR status, ``error.type`` and an OpenTelemetry ``exception`` event on ``span``.

    Strings are capped relative to ``limit`` (``otel.max-attribute-length``): the message
    at 4x, the stack trace at 16x.
    """
    exc_type, message = describe(exception, text)
    event = {"exception.type": exc_type, "exception.message": cap(message, limit * 4)}
    if traceback_text:
        stacktrace = f"Traceback (most recent call last):\n{traceback_text}{exc_type}: {message}"
        event["exception.stacktrace"] = cap(stacktrace, limit * 16)
    span.add_event("exception", {**event, **attributes}, timestamp=timestamp)
    span.set_attribute("error.type", exc_type)
    span.set_status(Status(StatusCode.ERROR, cap(f"{exc_type}: {message}", limit)))
