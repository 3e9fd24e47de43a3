"""The scheduler's structured events (``Scheduler.log_event``) as OpenTelemetry log records.

Workers added and removed (with the tasks they took with them), status changes,
retirements, restarts and every other topic: one record per event, named after its
``action`` (``add-worker``, ``remove-worker``, ...) or topic, its message as the body.
Strings in the body are capped at ``otel.max-attribute-length``; with
``otel.redact.exception-messages`` the exception fields Dask puts in events (e.g. a
worker's ``worker-fail-hard``) become ``[redacted]``, and with ``otel.redact.log-bodies``
every string in the body but its ``action``. A function and its arguments
(``run_on_scheduler``'s ``run-function``) never leave, nor do bytes (pickles): their
length does.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from time import time_ns
from typing import Any

from opentelemetry._logs import LoggerProvider, LogRecord, SeverityNumber

from dask_otel import strings
from dask_otel.runtime import SCOPE
from dask_otel.version import __version__

#: Items kept from a list, set or dict in an event body (e.g. lost task keys); the rest
#: are counted.
MAX_ITEMS = 100
#: Actions Dask publishes twice, under the worker's address and under ``all`` with a
#: ``worker`` field: exported from the ``all`` copy only.
MIRRORED_TO_ALL = frozenset({"add-worker", "remove-worker"})
#: Fields of an event body that hold an exception or its text (``error_message`` names).
EXCEPTION_FIELDS = frozenset({"exception", "exception_text", "traceback", "traceback_text"})
#: Fields of an event body that hold a function or its arguments: never exported.
ARGUMENT_FIELDS = frozenset({"function", "args", "kwargs"})


class EventRecorder:
    """Collects the topics of each event, then emits it as one log record."""

    def __init__(
        self, logger_provider: LoggerProvider, cluster_id: str, limit: int, exclude: Iterable[str]
    ) -> None:
        self._logger = logger_provider.get_logger(f"{SCOPE}.events", __version__)
        self._cluster_id = cluster_id
        self._limit = limit
        self._exclude = frozenset(exclude)
        self._pending: list[tuple[list[str], Any, int]] = []

    def add(self, topic: str, msg: Any) -> bool:
        """Note ``topic`` for ``msg``; True when a flush must be scheduled."""
        if topic in self._exclude:
            return False
        if "://" in topic and isinstance(msg, dict) and msg.get("action") in MIRRORED_TO_ALL:
            return False
        if self._pending and self._pending[-1][1] is msg:
            self._pending[-1][0].append(topic)
            return False
        self._pending.append(([topic], msg, time_ns()))
        return len(self._pending) == 1

    def __len__(self) -> int:
        """How many events were noted and not yet taken for export."""
        return len(self._pending)

    def take(self) -> list[tuple[list[str], Any, int]]:
        """Every event noted since the last call."""
        pending, self._pending = self._pending, []
        return pending

    def emit(self, topics: list[str], msg: Any, timestamp: int) -> None:
        addresses = [t for t in topics if "://" in t]
        named = [t for t in topics if "://" not in t and t != "all"]
        action = msg.get("action") if isinstance(msg, dict) else None
        name = str(action or (named[0] if named else "event"))
        attributes: dict[str, Any] = {
            "dask.cluster.id": self._cluster_id,
            "dask.event.topics": topics,
        }
        worker = (msg.get("worker") if isinstance(msg, dict) else None) or (
            addresses[0] if addresses else None
        )
        if isinstance(worker, str):
            attributes["dask.worker.address"] = worker
        self._logger.emit(
            LogRecord(
                timestamp=timestamp,
                observed_timestamp=time_ns(),
                severity_text="INFO",
                severity_number=SeverityNumber.INFO,
                body=_body(msg, self._limit),
                attributes=attributes,
                event_name=f"dask.{name}",
            )
        )


def _body(msg: Any, limit: int) -> Any:
    """The record body for event message ``msg``, redacted as configured."""
    redaction = strings.redaction
    if not isinstance(msg, dict):
        return _plain(msg, limit, redaction.log_bodies)
    body = {}
    for k, v in islice(msg.items(), MAX_ITEMS):
        name = strings.cap(strings.key_to_str(k), limit)
        if k in ARGUMENT_FIELDS or (
            k in EXCEPTION_FIELDS and redaction.exception_messages and v is not None
        ):
            body[name] = strings.REDACTED
        else:
            body[name] = _plain(v, limit, redaction.log_bodies and k != "action")
    if len(msg) > MAX_ITEMS:
        body["..."] = f"{len(msg) - MAX_ITEMS} more"
    return body


def _plain(value: Any, limit: int, redact: bool = False) -> Any:
    """``value`` as OTLP ``AnyValue`` data: maps, lists and scalars; strings capped, or
    all replaced by ``[redacted]`` with ``redact``."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, str):
        return strings.REDACTED if redact else strings.cap(value, limit)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"[{len(value)} bytes]"  # a pickle holds whatever was pickled
    if isinstance(value, dict):
        plain = {
            strings.cap(strings.key_to_str(k), limit): _plain(v, limit, redact)
            for k, v in islice(value.items(), MAX_ITEMS)
        }
        if len(value) > MAX_ITEMS:
            plain["..."] = f"{len(value) - MAX_ITEMS} more"
        return plain
    if isinstance(value, (list, tuple, set, frozenset)):
        plain_items = [
            _plain(strings.key_to_str(v) if isinstance(v, tuple) else v, limit, redact)
            for v in islice(value, MAX_ITEMS)
        ]
        if len(value) > MAX_ITEMS:
            plain_items.append(f"... {len(value) - MAX_ITEMS} more")
        return plain_items
    if redact or (isinstance(value, BaseException) and strings.redaction.exception_messages):
        return strings.REDACTED
    return strings.cap(strings.safe_repr(value), limit)
