"""OTLP JSON export requests (one a line: ``dask-otel demo``'s files, a collector's
``file`` exporter) read into plain records: the spans, log records and metric points
:mod:`dask_otel.tools.summary` counts. Anything that is not such a request raises
ValueError; nothing is trusted to be well formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: OTLP status code of an error, as the JSON exporters write it (number or name).
_ERROR = (2, "STATUS_CODE_ERROR")


def _value(any_value: dict[str, Any]) -> Any:
    """An OTLP JSON ``AnyValue`` as plain Python."""
    for kind, value in any_value.items():
        if kind == "intValue":
            return int(value)
        if kind == "doubleValue":
            return float(value)
        if kind == "arrayValue":
            return [_value(v) for v in value.get("values", [])]
        if kind == "kvlistValue":
            return _attributes(value.get("values"))
        return value
    return None


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {str(kv["key"]): _value(kv.get("value", {})) for kv in items or []}


def _nanoseconds(value: Any) -> int:
    """A timestamp: a decimal string or number of nanoseconds (not inf, not NaN)."""
    number = int(value or 0)  # int("1e999") and int(float("inf")) raise: skipped
    if not 0 <= number < 2**64:
        raise ValueError(f"timestamp out of range: {value!r}")
    return number


@dataclass(frozen=True)
class Span:
    """One span, as plain values."""

    trace: str
    span_id: str
    parent: str
    name: str
    role: str  #: ``service.name`` of the process that sent it
    start: int
    end: int
    error: bool
    message: str  #: status message
    attributes: dict[str, Any]
    exception: dict[str, Any]  #: attributes of its last ``exception`` event, if any
    #: Span ids it links to in its own trace, by ``dask.link`` relation (the first of each).
    links: dict[str, str] = field(default_factory=dict)

    @property
    def operation(self) -> str:
        return self.name.split(" ", 1)[0]

    @property
    def prefix(self) -> str:
        return str(self.attributes.get("dask.task.prefix") or self.name.partition(" ")[2])

    @property
    def key(self) -> str:
        return str(self.attributes.get("dask.task.key", ""))

    @property
    def worker(self) -> str:
        return str(self.attributes.get("dask.worker.address") or "")

    @property
    def seconds(self) -> float:
        return max(0, self.end - self.start) / 1e9

    @property
    def is_attempt(self) -> bool:
        """A task's run on a worker (or its loss): ``execute``, ``attempt`` and a worker's
        ``task`` span (the scheduler's has ``dask.task.state``)."""
        operation = self.operation
        if operation in ("execute", "attempt"):
            return True
        return operation == "task" and "dask.task.state" not in self.attributes

    @property
    def ran(self) -> bool:
        """An attempt timed where it ran (the worker's thread), not a loss the scheduler
        or a Nanny reported."""
        return bool(self.worker) and (self.operation == "execute" or "thread.id" in self.attributes)


@dataclass(frozen=True)
class LogRecord:
    role: str
    time: int
    observed: int
    severity: int
    severity_text: str
    body: str
    trace: str
    event_name: str
    attributes: dict[str, Any]


@dataclass
class Batch:
    """What one export request holds, read in full before any of it is counted (a line
    that fails half-way counts for nothing)."""

    spans: list[Span] = field(default_factory=list)
    logs: list[LogRecord] = field(default_factory=list)
    metric_points: int = 0
    #: ``dask_otel.exporter.dropped`` points: (process, signal, reason) -> (time, value)
    dropped: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)


def _resource(item: dict[str, Any]) -> dict[str, Any]:
    return _attributes(item.get("resource", {}).get("attributes"))


def _span(raw: dict[str, Any], role: str) -> Span:
    exception = next(
        (
            _attributes(event.get("attributes"))
            for event in reversed(raw.get("events") or [])
            if event.get("name") == "exception"
        ),
        {},
    )
    status = raw.get("status") or {}
    return Span(
        trace=str(raw.get("traceId", "")),
        span_id=str(raw.get("spanId", "")),
        parent=str(raw.get("parentSpanId") or ""),
        name=str(raw.get("name", "")),
        role=role,
        start=_nanoseconds(raw.get("startTimeUnixNano")),
        end=_nanoseconds(raw.get("endTimeUnixNano")),
        error=status.get("code") in _ERROR,
        message=str(status.get("message", "")),
        attributes=_attributes(raw.get("attributes")),
        exception=exception,
        links=_links(raw),
    )


def _links(raw: dict[str, Any]) -> dict[str, str]:
    links: dict[str, str] = {}
    for link in raw.get("links") or []:
        if link.get("traceId") == raw.get("traceId"):
            relation = str(_attributes(link.get("attributes")).get("dask.link", ""))
            links.setdefault(relation, str(link.get("spanId", "")))
    return links


#: OTLP's severity names, as protobuf's JSON mapping may write them, up to a level's first
#: number (``SEVERITY_NUMBER_INFO`` is 9, ``..._INFO2`` 10).
_SEVERITIES = {"TRACE": 1, "DEBUG": 5, "INFO": 9, "WARN": 13, "ERROR": 17, "FATAL": 21}


def _severity(value: Any) -> int:
    """A severity number, or its enum name (``SEVERITY_NUMBER_ERROR``); ValueError if neither."""
    if not isinstance(value, str) or not value.startswith("SEVERITY_NUMBER_"):
        return int(value or 0)
    name = value.removeprefix("SEVERITY_NUMBER_")
    if name == "UNSPECIFIED":
        return 0
    level, step = name.rstrip("234"), name[len(name.rstrip("234")) :] or "1"
    if level not in _SEVERITIES or len(step) != 1:
        raise ValueError(f"severity {value!r}")
    return _SEVERITIES[level] + int(step) - 1


def _log(raw: dict[str, Any], role: str) -> LogRecord:
    body = raw.get("body")
    return LogRecord(
        role=role,
        time=_nanoseconds(raw.get("timeUnixNano") or raw.get("observedTimeUnixNano")),
        observed=_nanoseconds(raw.get("observedTimeUnixNano")),
        severity=_severity(raw.get("severityNumber")),
        severity_text=str(raw.get("severityText") or "UNSET"),
        body=str(_value(body) if isinstance(body, dict) else body or ""),
        trace=str(raw.get("traceId") or ""),
        event_name=str(raw.get("eventName") or ""),
        attributes=_attributes(raw.get("attributes")),
    )


def parse(request: Any) -> Batch:
    """One OTLP JSON export request as a :class:`Batch`; ValueError if it is not one."""
    if not isinstance(request, dict):
        raise ValueError("JSON but not an OTLP export request")
    batch = Batch()
    if "resourceSpans" in request:
        for resource_spans in request["resourceSpans"]:
            role = str(_resource(resource_spans).get("service.name", "?"))
            for scope_spans in resource_spans.get("scopeSpans", []):
                batch.spans.extend(_span(raw, role) for raw in scope_spans.get("spans", []))
    elif "resourceLogs" in request:
        for resource_logs in request["resourceLogs"]:
            role = str(_resource(resource_logs).get("service.name", "?"))
            for scope_logs in resource_logs.get("scopeLogs", []):
                batch.logs.extend(_log(raw, role) for raw in scope_logs.get("logRecords", []))
    elif "resourceMetrics" in request:
        for resource_metrics in request["resourceMetrics"]:
            process = str(_resource(resource_metrics).get("service.instance.id", ""))
            for scope_metrics in resource_metrics.get("scopeMetrics", []):
                for metric in scope_metrics.get("metrics", []):
                    _add_metric(batch, metric, process)
    else:
        raise ValueError("JSON but not an OTLP export request")
    return batch


def _add_metric(batch: Batch, metric: dict[str, Any], process: str) -> None:
    for kind in ("sum", "gauge", "histogram", "exponentialHistogram", "summary"):
        points = (metric.get(kind) or {}).get("dataPoints", [])
        batch.metric_points += len(points)
        if metric.get("name") != "dask_otel.exporter.dropped":
            continue
        for point in points:
            attributes = _attributes(point.get("attributes"))
            series = (
                process,
                str(attributes.get("dask_otel.signal", "")),
                str(attributes.get("error.type", "")),
            )
            value = float(point.get("asInt", point.get("asDouble", 0)))
            if not math.isfinite(value):
                raise ValueError(f"metric value {value!r}")
            batch.dropped[series] = (_nanoseconds(point.get("timeUnixNano")), value)
