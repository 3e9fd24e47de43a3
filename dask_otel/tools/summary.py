"""``dask-otel summarize``: one screen on what a recorded run did and what went wrong.

Reads OTLP JSON lines (``dask-otel demo``'s files, a collector's ``file`` exporter: one
export request a line) from files and directories, streaming them line by line, and
answers: what failed, where and why (with the trace to open), what was slow, what moved
and spilled, per worker, when the task groups ran, the ERROR log records, and what is
missing from the recording. A line that cannot be read (truncated, foreign, hostile) is
skipped and reported; it never ends the summary.

Everything is counted from spans and log records, never from metrics (exported once a
minute, they lag what the spans show). Spans are told apart by name and attributes, not
by which process sent them, so both trace models read alike: ``execute``/``attempt``
spans and a worker's ``task`` span are attempts; a ``task`` span with
``dask.task.state`` is the scheduler's record of a task; a ``died`` span is an attempt
lost with its worker (a child of the scheduler's ``attempt`` span for it, in v2).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from dask_otel.tools import post_mortem

#: Rows printed per list; the rest is counted.
MAX_ROWS = 8
#: Waterfall bar width in characters, and how many traces get one.
BAR_WIDTH = 40
WATERFALL_TRACES = 2
#: Column widths of keys and names; longer ones are elided in the middle.
KEY_WIDTH = 44
NAME_WIDTH = 20
#: Skipped lines remembered (with why); the rest is counted.
MAX_SKIPPED = 5
#: OTLP status code of an error, as the JSON exporters write it (number or name).
_ERROR = (2, "STATUS_CODE_ERROR")
#: Severity numbers from ERROR up.
_ERROR_SEVERITY = 17


class SummaryError(Exception):
    """Nothing to summarize: the message says which path and why."""


# -- reading OTLP JSON ---------------------------------------------------------------------


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
    )


def _log(raw: dict[str, Any], role: str) -> LogRecord:
    body = raw.get("body")
    return LogRecord(
        role=role,
        time=_nanoseconds(raw.get("timeUnixNano") or raw.get("observedTimeUnixNano")),
        observed=_nanoseconds(raw.get("observedTimeUnixNano")),
        severity=int(raw.get("severityNumber") or 0),
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


# -- what the spans say ----------------------------------------------------------------------


@dataclass
class _Task:
    """One task (a key in a trace), from all the spans that name it."""

    prefix: str = ""
    #: Ids of the attempt spans seen, and of those that failed.
    attempt_ids: set[str] = field(default_factory=set)
    failed_ids: set[str] = field(default_factory=set)
    #: Parents of ``died`` spans: attempts lost with their worker, which the scheduler
    #: may have reported as an ``attempt`` span too (v2), or not (v1).
    lost: list[str] = field(default_factory=list)
    #: Attempts the scheduler counted (``dask.task.attempts``); 0 if no span said.
    counted: int = 0
    #: A ``task`` span said ERROR / OK; the latest attempt failed.
    erred: bool = False
    finished: bool = False
    last_attempt_failed: bool = False
    last_attempt_end: int = 0
    erred_by: str = ""
    workers: set[str] = field(default_factory=set)
    #: ``Type: message`` of the failure, and its rank (see Summary._add_task_span).
    exception: str = ""
    exception_rank: tuple[bool, int] = (False, -1)

    @property
    def attempts(self) -> int:
        return len(self.attempt_ids) + sum(p not in self.attempt_ids for p in self.lost)

    @property
    def failed_attempts(self) -> int:
        return len(self.failed_ids) + sum(p not in self.attempt_ids for p in self.lost)

    @property
    def failed(self) -> bool:
        """Failed for good: a ``task`` span said so, or none did and the last attempt failed."""
        return self.erred or (not self.finished and self.last_attempt_failed)


@dataclass
class _Worker:
    name: str = ""
    attempts: int = 0
    failed: int = 0
    compute: float = 0.0
    received: list[float] = field(default_factory=lambda: [0, 0.0])  #: transfers, bytes
    sent: list[float] = field(default_factory=lambda: [0, 0.0])
    spilled: list[float] = field(default_factory=lambda: [0, 0.0])
    unspilled: list[float] = field(default_factory=lambda: [0, 0.0])


@dataclass
class _Trace:
    root: str = ""
    root_role: str = ""
    start: int = 0
    end: int = 0
    spans: int = 0
    #: task prefix -> attempt intervals (start, end), for the waterfall
    groups: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))


def _describe(exception: dict[str, Any], fallback: str) -> str:
    """``Type: message``, without repeating the type when the message is a repr."""
    kind = str(exception.get("exception.type", "")).rsplit(".", 1)[-1]
    message = str(exception.get("exception.message", ""))
    if not kind:
        return fallback
    if message.startswith(kind):
        return message
    return f"{kind}: {message}" if message else kind


@dataclass
class Summary:
    """Aggregates of a recording, built one export request at a time."""

    files: int = 0
    spans: int = 0
    log_records: int = 0
    metric_points: int = 0
    skipped: list[str] = field(default_factory=list)
    skipped_count: int = 0
    traces: dict[str, _Trace] = field(default_factory=lambda: defaultdict(_Trace))
    tasks: dict[tuple[str, str], _Task] = field(default_factory=lambda: defaultdict(_Task))
    workers: dict[str, _Worker] = field(default_factory=lambda: defaultdict(_Worker))
    by_operation: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: (seconds, prefix, key, worker, trace): the slowest attempts and transfers (heaps)
    slowest: list[tuple[float, str, str, str, str]] = field(default_factory=list)
    slowest_transfers: list[tuple[float, float, str, str, str]] = field(default_factory=list)
    severities: Counter[str] = field(default_factory=Counter)
    #: (severity, role, first line of the body) -> [count, a trace id]
    errors: dict[tuple[str, str, str], list[Any]] = field(default_factory=dict)
    #: (process, signal, reason) -> (time, lost so far)
    dropped: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)
    span_ids: set[tuple[str, str]] = field(default_factory=set)
    log_ids: set[int] = field(default_factory=set)
    #: Spans and log records that arrived more than once, counted once.
    duplicates: Counter[str] = field(default_factory=Counter)
    parents: list[tuple[str, str]] = field(default_factory=list)
    deaths: post_mortem.Deaths = field(default_factory=post_mortem.Deaths)

    def skip(self, problem: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED:
            self.skipped.append(problem)

    def add(self, batch: Batch) -> None:
        """Fold in one export request's contents."""
        self.metric_points += batch.metric_points
        for series, (when, value) in batch.dropped.items():
            if when >= self.dropped.get(series, (-1, 0.0))[0]:
                self.dropped[series] = (when, value)
        for span in batch.spans:
            self._add_span(span)
        for record in batch.logs:
            self._add_log(record)

    # spans -------------------------------------------------------------------------------

    def _add_span(self, span: Span) -> None:
        if (span.trace, span.span_id) in self.span_ids:
            self.duplicates["spans"] += 1  # sent twice (a retried export, a Nanny's copy)
            return
        self.spans += 1
        self.by_operation[span.operation, span.role] += 1
        self.span_ids.add((span.trace, span.span_id))
        if span.parent:
            self.parents.append((span.trace, span.parent))
        trace = self.traces[span.trace]
        trace.spans += 1
        trace.start = min(trace.start or span.start, span.start)
        trace.end = max(trace.end, span.end)
        if not span.parent:
            trace.root, trace.root_role = span.name, span.role
        if span.key:
            self._add_task_span(span, trace)
        operation = span.operation
        if operation in ("transfer", "get_data", "spill", "unspill") and span.worker:
            self._add_movement(span)

    def _add_task_span(self, span: Span, trace: _Trace) -> None:
        task = self.tasks[span.trace, span.key]
        task.prefix = task.prefix or span.prefix
        if span.worker:
            task.workers.add(span.worker)
        task.workers.update(map(str, span.attributes.get("dask.task.workers") or ()))
        task.workers.update(map(str, span.exception.get("dask.task.workers") or ()))
        task.counted = max(task.counted, int(span.attributes.get("dask.task.attempts") or 0))
        # Why it failed: a `task` span's verdict over any attempt's, else the latest.
        rank = (span.operation == "task", span.end)
        if span.error and rank >= task.exception_rank:
            task.exception = _describe(span.exception, span.message)
            task.exception_rank = rank
        if span.operation == "died":
            task.lost.append(span.parent)
        if span.is_attempt:
            self._add_attempt(span, task, trace)
        if span.operation == "task":
            if span.error:
                task.erred = True
                task.erred_by = str(span.attributes.get("dask.task.erred_by") or "")
            elif span.attributes.get("dask.task.state", "memory") == "memory":
                task.finished = True

    def _add_attempt(self, span: Span, task: _Task, trace: _Trace) -> None:
        task.attempt_ids.add(span.span_id)
        if span.error:
            task.failed_ids.add(span.span_id)
        if span.end >= task.last_attempt_end:
            task.last_attempt_end, task.last_attempt_failed = span.end, span.error
        if not span.ran:
            return  # lost with its worker: no run to time
        worker = self.workers[span.worker]
        worker.name = worker.name or str(span.attributes.get("dask.worker.name") or "")
        worker.attempts += 1
        worker.failed += span.error
        worker.compute += span.seconds
        trace.groups[task.prefix].append((span.start, span.end))
        entry = (span.seconds, task.prefix, span.key, span.worker, span.trace)
        _keep_largest(self.slowest, entry)

    def _add_movement(self, span: Span) -> None:
        worker = self.workers[span.worker]
        worker.name = worker.name or str(span.attributes.get("dask.worker.name") or "")
        operation = span.operation
        if operation in ("spill", "unspill"):
            moved = float(span.attributes.get("dask.spill.bytes") or 0)
            tally = worker.spilled if operation == "spill" else worker.unspilled
        else:
            moved = float(span.attributes.get("dask.transfer.bytes") or 0)
            tally = worker.received if operation == "transfer" else worker.sent
            if span.attributes.get("dask.transfer.outcome", "success") != "success":
                return
            if operation == "transfer":
                peer = str(span.attributes.get("dask.peer.address") or "?")
                _keep_largest(
                    self.slowest_transfers, (span.seconds, moved, peer, span.worker, span.trace)
                )
        tally[0] += 1
        tally[1] += moved

    # logs --------------------------------------------------------------------------------

    def _add_log(self, record: LogRecord) -> None:
        identity = hash((record.time, record.observed, record.trace, record.body))
        if identity in self.log_ids:
            self.duplicates["log records"] += 1
            return
        self.log_ids.add(identity)
        self.log_records += 1
        self.severities[record.severity_text] += 1
        if record.event_name == post_mortem.DIED:
            self.deaths.add({"eventName": record.event_name, "timeUnixNano": record.time},
                            record.attributes)  # fmt: skip
        if record.severity >= _ERROR_SEVERITY:
            line = _headline(record.body)
            entry = self.errors.get((record.severity_text, record.role, line))
            if entry is not None:
                entry[0] += 1
            elif len(self.errors) < 4 * MAX_ROWS:
                self.errors[record.severity_text, record.role, line] = [1, record.trace]

    # conclusions ---------------------------------------------------------------------------

    def failures(self) -> list[tuple[str, str, _Task]]:
        """Tasks that failed for good, not because a dependency did: (trace, key, task)."""
        return sorted(
            ((trace, key, task) for (trace, key), task in self.tasks.items()
             if task.failed and not task.erred_by),
            key=lambda f: f[2].exception_rank[1],
        )  # fmt: skip

    def orphans(self) -> int:
        """Spans whose parent is not in the recording."""
        return sum(parent not in self.span_ids for parent in self.parents)

    def lost_by_exporters(self) -> Counter[tuple[str, str]]:
        """Items the processes' exporters said they lost, by signal and reason."""
        lost: Counter[tuple[str, str]] = Counter()
        for (_, signal, reason), (_, value) in self.dropped.items():
            lost[signal, reason] += int(value)
        return lost


def _headline(body: str) -> str:
    """A log body on one line: its first line, and the exception of a multi-line record
    such as Dask's ``Compute Failed`` (whose other lines name the task)."""
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if not lines:
        return ""
    said = [
        line[len("Exception:") :].strip(" '\"") for line in lines if line.startswith("Exception:")
    ]
    return ": ".join([lines[0], *said[:1]])


def _keep_largest(heap: list[Any], entry: Any, size: int = 5) -> None:
    if len(heap) < size:
        heapq.heappush(heap, entry)
    else:
        heapq.heappushpop(heap, entry)


# -- files ---------------------------------------------------------------------------------


def _files(paths: Iterable[Path]) -> list[Path]:
    """Every OTLP JSON file at or under ``paths`` (directories recursively), each once."""
    found: dict[Path, None] = {}
    for path in paths:
        if not path.exists():
            raise SummaryError(f"{path}: no such file or directory")
        if path.is_file():
            found[path] = None
            continue
        inside = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json"))
        if not inside:
            raise SummaryError(f"{path}: no .jsonl or .json files (OTLP JSON) in this directory")
        found.update(dict.fromkeys(p for p in inside if p.is_file()))
    return list(found)


def _lines(files: list[Path]) -> Iterator[tuple[Path, int, str]]:
    for file in files:
        with file.open(encoding="utf-8", errors="replace") as stream:
            for number, line in enumerate(stream, 1):
                if line.strip():
                    yield file, number, line


def summarize(paths: str | Path | Iterable[str | Path]) -> Summary:
    """Read every OTLP JSON file at ``paths`` (files, or directories searched
    recursively) into a Summary. Lines that cannot be read are skipped and counted."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    files = _files(paths)
    summary = Summary(files=len(files))
    for file, number, line in _lines(files):
        try:
            batch = parse(json.loads(line))
        except json.JSONDecodeError as e:
            summary.skip(f"{file}:{number}: not JSON (truncated?): {e.msg}")
        except RecursionError:
            summary.skip(f"{file}:{number}: JSON nested too deep to read")
        except Exception as e:  # anything else a foreign or hostile line can do
            summary.skip(f"{file}:{number}: not OTLP JSON ({type(e).__name__}: {e})"[:200])
        else:
            summary.add(batch)
    if not (summary.spans or summary.log_records or summary.metric_points):
        reasons = "; ".join(summary.skipped[:3]) or "the files are empty"
        where = ", ".join(map(str, paths))
        raise SummaryError(f"{where}: no OTLP telemetry found ({reasons})")
    return summary


# -- text ----------------------------------------------------------------------------------


def elide(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: whole, or its start and end around ``…``."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2 + (width - 1) % 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def _host(address: str) -> str:
    return address.removeprefix("tcp://")


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def _moved(tally: list[float]) -> str:
    return f"{int(tally[0])} / {_mb(tally[1])}" if tally[0] else "-"


def _when(nanoseconds: int) -> str:
    moment = datetime.fromtimestamp(nanoseconds / 1e9, timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


class _Report:
    """Writes the sections of :func:`render`."""

    def __init__(self, summary: Summary, out: TextIO) -> None:
        self.s = summary
        self.w = out.write
        self.out = out

    def header(self) -> None:
        s, w = self.s, self.w
        w(f"{s.files} file(s): {s.spans} spans, {s.log_records} log records, "
          f"{s.metric_points} metric points\n")  # fmt: skip
        if s.skipped_count:
            w(f"  skipped {s.skipped_count} line(s) that could not be read:\n")
            for problem in s.skipped:
                w(f"    {problem}\n")
            if s.skipped_count > len(s.skipped):
                w(f"    ... {s.skipped_count - len(s.skipped)} more\n")
        tasks = [t for t in s.tasks.values() if t.attempts or t.erred or t.finished]
        failed = sum(t.failed and not t.erred_by for t in tasks)
        dependents = sum(t.failed and bool(t.erred_by) for t in tasks)
        retried = sum(t.failed_attempts > 0 and not t.failed for t in tasks)
        attempts = sum(t.attempts for t in tasks)
        w(f"Tasks with spans: {len(tasks)} ({attempts} attempts); {failed} failed, "
          f"{dependents} failed because a dependency did, "
          f"{retried} recovered on retry\n")  # fmt: skip

    def traces(self) -> None:
        s, w = self.s, self.w
        ranked = sorted(s.traces.items(), key=lambda t: t[1].start)
        failed = Counter(trace for trace, _, _ in s.failures())
        first = min((t.start for _, t in ranked if t.start), default=0)
        last = max((t.end for _, t in ranked), default=0)
        span = f", {_when(first)}, {(last - first) / 1e9:.1f} s" if first else ""
        w(f"\nTraces ({len(ranked)}{span}):\n")
        w(f"  {'trace':<32}  {'root':<28} {'role':<15} {'spans':>6} {'seconds':>8} failed\n")
        for trace_id, trace in ranked[:MAX_ROWS]:
            root = elide(trace.root or "(root not recorded)", 28)
            w(f"  {trace_id:<32}  {root:<28} {trace.root_role:<15} {trace.spans:6} "
              f"{(trace.end - trace.start) / 1e9:8.2f} {failed.get(trace_id, 0):6}\n")  # fmt: skip
        if len(ranked) > MAX_ROWS:
            w(f"  ... {len(ranked) - MAX_ROWS} more traces\n")

    def failures(self) -> None:
        s, w = self.s, self.w
        failures = s.failures()
        w(f"\nFailed tasks ({len(failures)}):\n")
        for trace, key, task in failures[:MAX_ROWS]:
            workers = ", ".join(sorted(map(_host, task.workers))) or "no worker recorded"
            attempts = max(task.attempts, task.counted)
            w(f"  {elide(key, KEY_WIDTH)}  trace {trace}\n")
            w(f"      {elide(task.exception or '(no exception recorded)', 90)}\n")
            w(f"      {attempts} attempt(s) on {workers}\n")
        if len(failures) > MAX_ROWS:
            w(f"  ... {len(failures) - MAX_ROWS} more\n")
        dependents = Counter(t.prefix for t in s.tasks.values() if t.failed and t.erred_by)
        if dependents:
            counts = ", ".join(f"{n} {p}" for p, n in dependents.most_common(MAX_ROWS))
            w(f"  and because a dependency failed: {counts}\n")

    def slowest(self) -> None:
        s, w = self.s, self.w
        if s.slowest:
            w("\nSlowest task attempts:\n")
            for seconds, _prefix, key, worker, trace in sorted(s.slowest, reverse=True):
                w(f"  {seconds:8.3f} s  {elide(key, KEY_WIDTH):<{KEY_WIDTH}}  "
                  f"{_host(worker):<21} trace {trace}\n")  # fmt: skip

    def movement(self) -> None:
        s, w = self.s, self.w
        totals = {
            name: [sum(getattr(x, name)[i] for x in s.workers.values()) for i in (0, 1)]
            for name in ("received", "spilled", "unspilled")
        }
        w("\nData movement:\n")
        received = totals["received"]
        w(f"  transfers between workers: {_moved(received)}\n")
        for seconds, moved, peer, worker, trace in sorted(s.slowest_transfers, reverse=True)[:3]:
            w(f"    {seconds:6.3f} s  {_mb(moved):>9}  {_host(peer)} -> {_host(worker)}  "
              f"trace {trace}\n")  # fmt: skip
        w(f"  spilled to disk: {_moved(totals['spilled'])}; "
          f"read back: {_moved(totals['unspilled'])}\n")  # fmt: skip

    def per_worker(self) -> None:
        s, w = self.s, self.w
        if not s.workers:
            return
        w("\nPer worker (transfers and spills: count / size):\n")
        w(f"  {'worker':<21} {'name':<10} {'attempts':>8} {'failed':>6} {'compute s':>9}  "
          f"{'received':<13} {'sent':<13} {'spilled':<13} {'read back':<13}\n")  # fmt: skip
        rows = sorted(s.workers.items())
        for address, worker in rows[:MAX_ROWS]:
            name = "-" if worker.name in ("", address) else elide(worker.name, 10)
            w(f"  {_host(address):<21} {name:<10} {worker.attempts:8} "
              f"{worker.failed:6} {worker.compute:9.2f}  {_moved(worker.received):<13} "
              f"{_moved(worker.sent):<13} {_moved(worker.spilled):<13} "
              f"{_moved(worker.unspilled):<13}\n")  # fmt: skip
        if len(rows) > MAX_ROWS:
            w(f"  ... {len(rows) - MAX_ROWS} more workers\n")

    def waterfall(self) -> None:
        s, w = self.s, self.w
        # The traces with the most task groups, then the most attempts.
        busiest = sorted(
            (t for t in s.traces.items() if t[1].groups),
            key=lambda t: (-len(t[1].groups), -sum(map(len, t[1].groups.values()))),
        )[:WATERFALL_TRACES]
        for trace_id, trace in sorted(busiest, key=lambda t: t[1].start):
            length = max(trace.end - trace.start, 1)
            w(f"\nWhen task groups ran: {elide(trace.root or trace_id, 40)}, "
              f"{length / 1e9:.2f} s, trace {trace_id}\n")  # fmt: skip
            groups = sorted(trace.groups.items(), key=lambda g: min(g[1]))
            for prefix, intervals in groups[:MAX_ROWS]:
                bar = [" "] * BAR_WIDTH
                for start, end in intervals:
                    first = int(BAR_WIDTH * (start - trace.start) / length)
                    last = int(BAR_WIDTH * (end - trace.start) / length)
                    for i in range(max(0, first), min(BAR_WIDTH - 1, last) + 1):
                        bar[i] = "#"
                began = (min(s for s, _ in intervals) - trace.start) / 1e9
                ended = (max(e for _, e in intervals) - trace.start) / 1e9
                w(f"  {elide(prefix, NAME_WIDTH):<{NAME_WIDTH}} |{''.join(bar)}| "
                  f"{began:5.2f}-{ended:.2f} s  {len(intervals)} run(s)\n")  # fmt: skip
            if len(groups) > MAX_ROWS:
                w(f"  ... {len(groups) - MAX_ROWS} more groups\n")

    def logs(self) -> None:
        s, w = self.s, self.w
        if not s.severities:
            return
        counts = ", ".join(f"{n} {sev}" for sev, n in sorted(s.severities.items()))
        w(f"\nLog records: {counts}\n")
        errors = sorted(s.errors.items(), key=lambda e: -e[1][0])
        for (severity, role, line), (count, trace) in errors[:MAX_ROWS]:
            where = f"  trace {trace}" if trace else ""
            w(f"  {severity} x{count} {role}: {elide(line, 64)}{where}\n")
        if len(errors) > MAX_ROWS:
            w(f"  ... {len(errors) - MAX_ROWS} more distinct ERROR records\n")

    def missing(self) -> None:
        s, w = self.s, self.w
        findings = []
        unseen = {
            key: task.counted - task.attempts
            for (_, key), task in s.tasks.items()
            if task.failed and task.counted > task.attempts
        }
        if unseen:
            keys = ", ".join(elide(k, 30) for k in list(unseen)[:3])
            findings.append(
                f"{sum(unseen.values())} attempt(s) of {len(unseen)} failed task(s) have no "
                f"span ({keys}): their workers died before exporting, or did not trace them"
            )
        orphans = s.orphans()
        if orphans:
            findings.append(
                f"{orphans} span(s) name a parent that is not in the recording (a process "
                "whose telemetry is missing, or spans lost on the way)"
            )
        rootless = sum(not t.root for t in s.traces.values())
        if rootless:
            findings.append(f"{rootless} trace(s) without their root span")
        if s.duplicates:
            twice = " and ".join(f"{n} {what}" for what, n in sorted(s.duplicates.items()))
            findings.append(f"{twice} arrived more than once (counted once)")
        lost = s.lost_by_exporters()
        if any(lost.values()):
            nouns = {"traces": "spans", "logs": "log records"}
            said = ", ".join(
                f"{n} {nouns.get(signal, signal)} ({reason.replace('_', ' ')})"
                for (signal, reason), n in sorted(lost.items())
                if n
            )
            findings.append(f"the exporters said they lost {said} (dask_otel.exporter.dropped)")
        w("\nGaps in the recording:" + (" none found\n" if not findings else "\n"))
        for finding in findings:
            w(f"  - {finding}\n")

    def deaths(self) -> None:
        if self.s.deaths.count:
            # The failures a death explains: attempts lost with their workers.
            failures = [
                {"name": f"task {t.prefix}", "key": key, "workers": t.workers,
                 "exception": t.exception}
                for _, key, t in self.s.failures()
                if t.lost or "KilledWorker" in t.exception
            ]  # fmt: skip
            post_mortem.render(self.s.deaths, failures, self.out)


def render(summary: Summary, out: TextIO) -> None:
    """Print the summary as text."""
    report = _Report(summary, out)
    report.header()
    report.traces()
    report.failures()
    report.slowest()
    report.movement()
    report.per_worker()
    report.waterfall()
    report.logs()
    report.missing()
    report.deaths()
