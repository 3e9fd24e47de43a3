"""What an ``exception`` span event says about a task's failure, computed safely.

Dask hands exceptions around pickled, with their repr and traceback as text. Turning
them into ``exception.*`` attributes must never raise (``str()`` of a user exception can)
and never keep them: a :class:`Failure` is text only, made where the failure is seen.
With ``otel.redact.exception-messages`` the message and stack trace become
:data:`REDACTED`; the exception's type stays.
"""

from __future__ import annotations

import ast
import io
import pickle
import re
import sys
import traceback
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dask_otel.strings import (
    REDACTED,
    TYPE_NAME,
    cap,
    max_length,
    redaction,
    safe_repr,
    safe_str,
    type_name,
)


def hide_frame(error: BaseException) -> None:
    """Take the calling wrapper's frame off the head of ``error``'s traceback, just before
    the wrapper's bare ``raise``, which from Python 3.11 adds no entry: users see the
    traceback plain Dask gives, without dask-otel's frames (3.10 puts the entry back)."""
    tb = error.__traceback__
    if tb is not None and tb.tb_frame is sys._getframe(1):
        error.__traceback__ = tb.tb_next


class Failure(NamedTuple):
    """A failure reduced to text where it happened, so that what reports it later (the
    emitter thread) holds no exception, traceback, frame or task data: its type, message
    and stack (Dask's ``traceback_text``, or frames as names and line numbers only)."""

    type: str
    message: str
    stack: str | traceback.StackSummary | None = None


def failure(exception: Any, text: Any = None, traceback_text: str | None = None) -> Failure:
    """What :func:`record_exception` needs, from an exception or Dask's account of one
    (its pickle, its repr as ``text``, its frames as ``traceback_text``). Cheap enough for
    the event loop (no source lines are read); never raises."""
    exc_type, message = describe(exception, text)
    stack: str | traceback.StackSummary | None = traceback_text
    if stack is None and isinstance(exception, BaseException):
        try:
            tb = traceback.walk_tb(exception.__traceback__)
            stack = traceback.StackSummary.extract(tb, lookup_lines=False)
        except Exception:
            stack = None
    return Failure(exc_type, message, stack)


def describe(exception: Any, text: Any) -> tuple[str, str]:
    """(``exception.type``, ``exception.message``) from what Dask recorded; never raises.

    ``exception`` may be the exception, its pickle (bytes), or a wrapper holding either
    in ``.data``; ``text`` is its repr. A pickle is never loaded (that would run the
    user's code, copy the objects the exception holds and, for a class pickled by value,
    reset the class's attributes): only the class it names is read. The message is then
    the exception's ``str()`` when its repr is the default one of literal arguments
    (``ValueError('boom')``), else the repr.
    """
    if not isinstance(exception, BaseException):  # an exception's own ``.data`` is not a wrapper
        try:
            exception = _pickle_of(getattr(exception, "data", exception))
        except Exception:
            exception = None
    if text is not None and not isinstance(text, str):
        text = safe_repr(text)
    text_type = _text_type(text)
    if isinstance(exception, BaseException):
        message = safe_str(exception)
        if type(exception) is Exception and text_type and message == text:
            # Dask sends ``Exception(repr(e))`` for an exception it cannot pickle: the
            # repr still names the original type, as the scheduler sees it.
            return text_type, message
        return type_name(exception), message
    named = _pickled_class(exception) if isinstance(exception, (bytes, bytearray)) else None
    if named is not None:
        module, name = named
        if module.startswith("cloudpickle"):  # a class pickled by value: the repr names it
            module, name = "builtins", text_type or "Exception"
        # Dask's stand-in ``Exception(repr(e))``, or a pickle that names something else
        # first (a user's ``__reduce__``): the repr's type, as below.
        if text_type in (None, name.rsplit(".", 1)[-1]):
            exc_type = name if module == "builtins" else f"{module}.{name}"
            return exc_type, "" if text is None else _message_from_repr(text, exc_type)
    if text:
        return text_type or "Exception", _message_from_repr(text, text_type) if text_type else text
    return "Exception", "unknown error"


def _pickle_of(exception: Any) -> Any:
    """The pickle in Dask's ``Serialized`` (a worker's exception as the scheduler holds it,
    unread), else ``exception`` itself."""
    frames = getattr(exception, "frames", None)
    header = getattr(exception, "header", None)
    pickled = isinstance(header, dict) and header.get("serializer") == "pickle"
    if pickled and isinstance(frames, list) and frames:
        return bytes(frames[0])
    return exception


class _Named(Exception):
    """Raised by :class:`_FirstClass` with the (module, name) of the class it found."""


class _FirstClass(pickle.Unpickler):
    """Reads a pickle only as far as the first class it names (past the helpers Dask's
    traceback pickling wraps an exception in), and builds nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("tblib"):
            return _never_called
        raise _Named(module, name)


def _never_called(*args: Any, **kwargs: Any) -> None:
    """Stands for tblib's helpers: the reading stops before anything is called."""


def _pickled_class(data: bytes | bytearray) -> tuple[str, str] | None:
    """(module, qualified name) of the class a pickled exception names first, or None."""
    try:
        _FirstClass(io.BytesIO(data)).load()
    except _Named as named:
        return named.args  # type: ignore[return-value]
    except Exception:
        pass
    return None


#: Longest repr whose arguments are parsed for the message (longer ones are capped anyway).
_MAX_PARSED = 4096


def _message_from_repr(text: str, exc_type: str) -> str:
    """``str()`` of the exception whose default repr is ``text``, if its arguments are
    literals (``ValueError('boom')`` -> ``boom``); else ``text``."""
    if len(text) > _MAX_PARSED:
        return text
    try:
        call = ast.parse(text, mode="eval").body
        if not isinstance(call, ast.Call) or call.keywords:
            return text
        args = tuple(ast.literal_eval(arg) for arg in call.args)
    except Exception:  # not Python, not literals, nested too deep
        return text
    if len(args) != 1:
        return str(args) if args else ""
    return repr(args[0]) if exc_type == "KeyError" else str(args[0])


#: The class name at the start of an exception's repr, e.g. ``KeyError`` in ``KeyError('k')``.
_REPR_TYPE = re.compile(TYPE_NAME + r"\(")


def _text_type(text: str | None) -> str | None:
    match = _REPR_TYPE.match(text) if text else None
    return match.group(1) if match else None


def record_exception(
    span: trace.Span,
    failure: Failure,
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
    exc_type, message, stack = failure
    traceback_text = "".join(stack.format()) if isinstance(stack, traceback.StackSummary) else stack
    if redaction.exception_messages if redact is None else redact:
        message = REDACTED
        traceback_text = REDACTED if traceback_text else None
        stacktrace = REDACTED
    else:
        stacktrace = f"Traceback (most recent call last):\n{traceback_text}{exc_type}: {message}"
    event = {
        "exception.type": exc_type,
        "exception.message": cap(message, max_length("exception.message", limit)),
    }
    if traceback_text:
        event["exception.stacktrace"] = cap(stacktrace, max_length("exception.stacktrace", limit))
    span.add_event("exception", {**event, **attributes}, timestamp=timestamp)
    span.set_attribute("error.type", exc_type)
    span.set_status(Status(StatusCode.ERROR, cap(f"{exc_type}: {message}", limit)))
