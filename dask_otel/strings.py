"""Text as it leaves dask-otel: a key's stable form, strings UTF-8 can carry and capped
to their length, redaction, and the text of an exception.

Every string dask-otel builds passes :func:`cap`; how long each kind may be is
:func:`max_length`'s answer, relative to ``otel.max-attribute-length``. The redaction in
force (``otel.redact.*``) is process state, set whenever a component activates. Nothing
here imports the rest of dask-otel: spans, signals and the export path all stand on it.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Status, StatusCode


def key_to_str(key: Any) -> str:
    """The stable text form of a Dask key (tuple keys included), identical on every host."""
    return key if isinstance(key, str) else str(key)


#: Code points UTF-8 cannot carry: lone surrogates, which ``os.fsdecode`` and
#: ``os.listdir`` make of a file name's undecodable bytes.
_SURROGATES = re.compile("[\ud800-\udfff]")


def clean(text: str) -> str:
    """``text`` as UTF-8 can carry it: each lone surrogate becomes U+FFFD (an OTLP
    exporter fails a whole batch on one)."""
    return text if text.isascii() else _SURROGATES.sub("\ufffd", text)


def cap(text: str, limit: int) -> str:
    """Truncate ``text`` to ``limit`` characters, marking the cut with an ellipsis; made
    :func:`clean`: every string dask-otel builds passes here."""
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026" if limit > 0 else ""
    return text if text.isascii() else _SURROGATES.sub("\ufffd", text)  # clean(), inline


def cut_to_bytes(text: str, size: int) -> str:
    """``text`` if its UTF-8 takes at most ``size`` bytes, else its longest start that
    does with an ellipsis marking the cut, cut between characters (never inside one).
    For room measured in bytes (a fixed slot of shared memory), where :func:`cap`
    counts characters."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= size:
        return text
    mark = "\u2026" if size >= 3 else ""  # 3 bytes of UTF-8
    end = size - len(mark) * 3
    while end and data[end] & 0xC0 == 0x80:  # a continuation byte: inside a character
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass") + mark


#: A (dotted) Python name, as exception types are written.
TYPE_NAME = r"([A-Za-z_][\w.]*)"
#: The type at the start of the text Dask has of an exception (its repr or its str).
LEADING_TYPE = re.compile(TYPE_NAME)
#: What replaces a redacted exception message, stack trace or log body.
REDACTED = "[redacted]"
#: Attributes of an ``exception`` event (and of a log record) that carry its text.
EXCEPTION_TEXT = ("exception.message", "exception.stacktrace")
#: How many times ``otel.max-attribute-length`` each kind of longer text may be: an
#: exception's message and stack trace (on spans and log records) and a log record's body
#: (Dask's "Compute Failed" body holds a stack trace).
LENGTH_FACTORS = {"exception.message": 4, "exception.stacktrace": 16, "log.body": 16}


def max_length(kind: str, limit: int) -> int:
    """How many characters text of ``kind`` (an attribute's name, or ``log.body``) may have
    where ``otel.max-attribute-length`` is ``limit``: ``limit`` itself for all but the
    kinds of :data:`LENGTH_FACTORS`."""
    return limit * LENGTH_FACTORS.get(kind, 1)


#: The type at the start of an ERROR status's description, as the SDK writes it
#: (``ValueError: message``).
_DESCRIBED_TYPE = re.compile(TYPE_NAME + ": ")


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


def redact_description(description: str) -> str:
    """An ERROR status's description without the exception's message: ``ValueError:
    [redacted]`` for the SDK's ``ValueError: message``, else :data:`REDACTED`."""
    match = _DESCRIBED_TYPE.match(description)
    return f"{match.group(1)}: {REDACTED}" if match else REDACTED


def redact_status(
    status: Status | StatusCode, description: str | None
) -> tuple[Status | StatusCode, str | None]:
    """``set_status``'s arguments, an ERROR's description redacted (either form)."""
    if isinstance(status, Status):
        if status.status_code is StatusCode.ERROR and status.description:
            status = Status(StatusCode.ERROR, redact_description(status.description))
    elif status is StatusCode.ERROR and description:
        description = redact_description(description)
    return status, description


def redact_exception_text(attributes: Any) -> Any:
    """``attributes`` of an ``exception`` event or a log record, a copy with its message
    and stack trace redacted if it had them."""
    if not attributes or not any(name in attributes for name in EXCEPTION_TEXT):
        return attributes
    redacted = dict(attributes)
    for name in EXCEPTION_TEXT:
        if name in redacted:
            redacted[name] = REDACTED
    return redacted


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


def safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}: repr() failed>"


def exception_attributes(
    exception: BaseException, attributes: Any = None, escaped: bool = False
) -> dict[str, Any]:
    """The attributes of the SDK's ``exception`` event for ``exception`` (as
    ``Span.record_exception`` makes them); message and stack trace :data:`REDACTED` with
    ``otel.redact.exception-messages``."""
    if redaction.exception_messages:
        message = stack = REDACTED
    else:
        message = safe_str(exception)
        stack = "".join(traceback.format_exception(exception))
    return {
        "exception.type": type_name(exception),
        "exception.message": message,
        "exception.stacktrace": stack,
        "exception.escaped": str(escaped),
        **(attributes or {}),
    }
