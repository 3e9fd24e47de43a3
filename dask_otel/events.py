"""The scheduler's structured events (``Scheduler.log_event``) as OpenTelemetry log records.

Workers added and removed (with the tasks they took with them), status changes,
retirements, restarts and every other topic: one record per event, named after its
``action`` (``add-worker``, ``remove-worker``, ...) or topic, its message as the body.
"""

from __future__ import annotations

from collections.abc import Iterable
from time import time_ns
from typing import Any

from opentelemetry._logs import LoggerProvider, LogRecord, SeverityNumber

from dask_otel import ids
from dask_otel.telemetry import SCOPE
from dask_otel.version import __version__

#: Items kept from a list or set in an event body (e.g. lost task keys); the rest counted.
MAX_ITEMS = 100
#: Actions Dask publishes twice, under the worker's address and under ``all`` with a
#: ``worker`` field: exported from the ``all`` copy only.
MIRRORED_TO_ALL = frozenset({"add-worker", "remove-worker"})


class EventExporter:
    """Collects the topics of one event, then emits it as a log record."""

    def __init__(self, logger_provider: LoggerProvider, cluster_id: str, limit: int) -> None:
        self._logger = logger_provider.get_logger(f"{SCOPE}.events", __version__)
        self._cluster_id = cluster_id
        self._limit = limit
        self._pending: tuple[list[str], Any, int] | None = None

    def add(self, topic: str, msg: Any) -> bool:
        """Note ``topic`` for ``msg``; True when ``msg`` starts a new event."""
        if "://" in topic and isinstance(msg, dict) and msg.get("action") in MIRRORED_TO_ALL:
            return False
        if self._pending is not None and self._pending[1] is msg:
            self._pending[0].append(topic)
            return False
        self._pending = ([topic], msg, time_ns())
        return True

    def take(self) -> tuple[list[str], Any, int] | None:
        pending, self._pending = self._pending, None
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
                body=_plain(msg, self._limit),
                attributes=attributes,
                event_name=f"dask.{name}",
            )
        )


def _plain(value: Any, limit: int) -> Any:
    """``value`` as OTLP ``AnyValue`` data: maps, lists and scalars; strings capped."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, str):
        return ids.cap(value, limit)
    if isinstance(value, dict):
        return {ids.cap(str(k), limit): _plain(v, limit) for k, v in value.items()}
    if isinstance(value, Iterable) and not isinstance(value, bytes):
        items = list(value)
        plain = [
            _plain(ids.key_to_str(v) if isinstance(v, tuple) else v, limit)
            for v in items[:MAX_ITEMS]
        ]
        if len(items) > MAX_ITEMS:
            plain.append(f"... {len(items) - MAX_ITEMS} more")
        return plain
    return ids.cap(repr(value), limit)
