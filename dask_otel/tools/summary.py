"""``dask-otel summarize``: what a recorded run did, from OTLP JSON files.

Reads the files of ``dask-otel demo`` or of a collector's ``file`` exporter (one OTLP JSON
export request per line), streaming them line by line so large recordings never sit in
memory whole, and prints: the traces, span counts per operation and role, the slowest
tasks, the failures with their workers and exceptions, transfer and spill totals, a few
metric values, and a waterfall of task groups per trace.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dask_otel.tools import post_mortem

#: Waterfall bar width in characters, and how many traces get one.
BAR_WIDTH = 40
WATERFALL_TRACES = 3
#: Rows of each list printed, and problems remembered, before the rest is only counted.
MAX_ROWS = 20


class SummaryError(Exception):
    """Nothing to summarize: the message says which path and why."""


def _value(any_value: dict[str, Any]) -> Any:
    """An OTLP JSON ``AnyValue`` as plain Python."""
    for kind, value in any_value.items():
        if kind == "intValue":
            return int(value)
        if kind == "arrayValue":
            return [_value(v) for v in value.get("values", [])]
        if kind == "kvlistValue":
            return {kv["key"]: _value(kv.get("value", {})) for kv in value.get("values", [])}
        return value
    return None


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in items or []}


@dataclass
class _Trace:
    root: str = ""
    start: int = 0
    end: int = 0
    spans: int = 0
    #: task prefix -> [first start, last end, task count]
    groups: dict[str, list[int]] = field(default_factory=dict)


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
    by_operation: Counter[tuple[str, str]] = field(default_factory=Counter)
    slowest: list[tuple[float, str, str, str]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: tasks that erred because a dependency did: counted, not listed
    erred_dependents: int = 0
    severities: Counter[str] = field(default_factory=Counter)
    #: (metric name, attributes, process) -> (time, value, label); the latest point of a
    #: cumulative series is its total
    metrics: dict[tuple[str, str, str], tuple[int, float, str]] = field(default_factory=dict)
    deaths: post_mortem.Deaths = field(default_factory=post_mortem.Deaths)

    def skip(self, problem: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_ROWS:
            self.skipped.append(problem)

    def add_request(self, request: dict[str, Any]) -> bool:
        """Fold one OTLP JSON export request in; False if it is not one."""
        if "resourceSpans" in request:
            for resource_spans in request["resourceSpans"]:
                self._add_spans(resource_spans)
        elif "resourceLogs" in request:
            for resource_logs in request["resourceLogs"]:
                for scope_logs in resource_logs.get("scopeLogs", []):
                    for record in scope_logs.get("logRecords", []):
                        self.log_records += 1
                        self.severities[record.get("severityText") or "UNSET"] += 1
                        if record.get("eventName") == post_mortem.DIED:
                            self.deaths.add(record, _attributes(record.get("attributes")))
        elif "resourceMetrics" in request:
            for resource_metrics in request["resourceMetrics"]:
                resource = _attributes(resource_metrics.get("resource", {}).get("attributes"))
                process = str(resource.get("service.instance.id", ""))
                for scope_metrics in resource_metrics.get("scopeMetrics", []):
                    for metric in scope_metrics.get("metrics", []):
                        self._add_metric(metric, process)
        else:
            return False
        return True

    def _add_spans(self, resource_spans: dict[str, Any]) -> None:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes"))
        role = str(resource.get("service.name", "?"))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                self.spans += 1
                self._add_span(span, role)

    def _add_span(self, span: dict[str, Any], role: str) -> None:
        name = span.get("name", "")
        operation = name.split(" ", 1)[0]
        start, end = int(span.get("startTimeUnixNano", 0)), int(span.get("endTimeUnixNano", 0))
        attributes = _attributes(span.get("attributes"))
        self.by_operation[operation, role] += 1
        trace = self.traces[span.get("traceId", "")]
        trace.spans += 1
        trace.start = min(trace.start or start, start)
        trace.end = max(trace.end, end)
        if not span.get("parentSpanId"):
            trace.root = name
        key = str(attributes.get("dask.task.key", ""))
        if operation == "task":
            group = trace.groups.setdefault(name.split(" ", 1)[-1], [start, end, 0])
            group[0], group[1], group[2] = min(group[0], start), max(group[1], end), group[2] + 1
            if span.get("status", {}).get("code") in (2, "STATUS_CODE_ERROR"):
                if attributes.get("dask.task.erred_by"):
                    self.erred_dependents += 1
                elif len(self.failures) < MAX_ROWS:
                    self._add_failure(span, attributes, key)
        if operation == "execute" or "dask.task.compute_seconds" in attributes:
            # An attempt as its worker timed it (`task`/`attempt`; `execute` with the
            # scheduler's task spans).
            entry = ((end - start) / 1e9, name, key, str(attributes.get("dask.worker.address")))
            if len(self.slowest) < 5:
                heapq.heappush(self.slowest, entry)
            else:
                heapq.heappushpop(self.slowest, entry)

    def _add_failure(self, span: dict[str, Any], attributes: dict[str, Any], key: str) -> None:
        exception = next(
            (
                _attributes(e.get("attributes"))
                for e in span.get("events", [])
                if e.get("name") == "exception"
            ),
            {},
        )
        self.failures.append(
            {
                "name": span.get("name", ""),
                "key": key,
                "attempts": attributes.get("dask.task.attempts"),
                "workers": exception.get("dask.task.workers")
                or [attributes.get("dask.worker.address")],
                "exception": _describe(exception) or span.get("status", {}).get("message", ""),
            }
        )

    def _add_metric(self, metric: dict[str, Any], process: str) -> None:
        name = metric.get("name", "")
        for kind in ("sum", "gauge", "histogram"):
            for point in metric.get(kind, {}).get("dataPoints", []):
                self.metric_points += 1
                attributes = _attributes(point.get("attributes"))
                label = str(
                    attributes.get("dask.spill.activity")
                    or attributes.get("dask.task.state")
                    or attributes.get("dask.transfer.direction")
                    or ""
                )
                if kind == "histogram":
                    value = float(point.get("sum", 0.0))
                else:
                    value = float(point.get("asDouble", point.get("asInt", 0)))
                when = int(point.get("timeUnixNano", 0))
                series = (name, json.dumps(attributes, sort_keys=True, default=str), process)
                previous = self.metrics.get(series)
                temporality = metric.get(kind, {}).get("aggregationTemporality")
                if previous is not None and temporality in (1, "AGGREGATION_TEMPORALITY_DELTA"):
                    self.metrics[series] = (max(when, previous[0]), previous[1] + value, label)
                elif previous is None or previous[0] <= when:
                    self.metrics[series] = (when, value, label)

    def metric_total(self, name: str, label: str | None = None) -> float:
        """Sum over series (processes, attributes) of the latest value of ``name``."""
        return sum(
            value
            for (metric, _, _), (_, value, series_label) in self.metrics.items()
            if metric == name and (label is None or series_label == label)
        )


def _describe(exception: dict[str, Any]) -> str:
    """``Type: message``, without repeating the type when the message is a repr."""
    exc_type = str(exception.get("exception.type", ""))
    message = str(exception.get("exception.message", ""))
    if not exc_type or message.startswith(exc_type.rsplit(".", 1)[-1]):
        return message
    return f"{exc_type}: {message}"


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise SummaryError(f"{path}: no such file or directory")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json") and p.is_file())
    if not files:
        raise SummaryError(f"{path}: no .jsonl or .json files (OTLP JSON) in this directory")
    return files


def _lines(files: list[Path]) -> Iterator[tuple[Path, int, str]]:
    for file in files:
        with file.open(encoding="utf-8", errors="replace") as stream:
            for number, line in enumerate(stream, 1):
                if line.strip():
                    yield file, number, line


def summarize(path: str | Path) -> Summary:
    """Read every OTLP JSON file at ``path`` (a file or a directory) into a Summary."""
    files = _files(Path(path))
    summary = Summary(files=len(files))
    for file, number, line in _lines(files):
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            summary.skip(f"{file}:{number}: not JSON (truncated?): {e.msg}")
            continue
        try:
            if not isinstance(request, dict) or not summary.add_request(request):
                summary.skip(f"{file}:{number}: JSON but not an OTLP export request")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            summary.skip(f"{file}:{number}: malformed OTLP JSON ({type(e).__name__}: {e})")
    if not (summary.spans or summary.log_records or summary.metric_points):
        reasons = "; ".join(summary.skipped[:3]) or "the files are empty"
        raise SummaryError(f"{path}: no OTLP telemetry found ({reasons})")
    return summary


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def _waterfall(trace_id: str, trace: _Trace, out: TextIO) -> None:
    span = max(trace.end - trace.start, 1)
    out.write(f"\n  trace {trace_id}  {trace.root}  ({(trace.end - trace.start) / 1e9:.2f} s)\n")
    for prefix, (start, end, count) in sorted(trace.groups.items(), key=lambda g: g[1][0]):
        left = int(BAR_WIDTH * (start - trace.start) / span)
        width = max(1, int(BAR_WIDTH * (end - start) / span))
        bar = " " * left + "#" * min(width, BAR_WIDTH - left)
        out.write(
            f"    {prefix[:24]:<24} |{bar:<{BAR_WIDTH}}| {(start - trace.start) / 1e9:6.2f}s"
            f" +{(end - start) / 1e9:.2f}s  {count} task{'s' if count != 1 else ''}\n"
        )


def render(summary: Summary, out: TextIO) -> None:
    """Print the summary as text."""
    w = out.write
    w(
        f"{summary.files} file(s): {summary.spans} spans, {summary.log_records} log records, "
        f"{summary.metric_points} metric points\n"
    )
    for problem in summary.skipped[:5]:
        w(f"  skipped {problem}\n")
    if summary.skipped_count > 5:
        w(f"  ... {summary.skipped_count - 5} more lines skipped\n")
    w(f"\nTraces ({len(summary.traces)}):\n")
    ranked = sorted(summary.traces.items(), key=lambda t: t[1].start)
    for trace_id, trace in ranked[:MAX_ROWS]:
        w(f"  {trace_id}  {trace.root or '(root not recorded)':<28} {trace.spans:6} spans  "
          f"{(trace.end - trace.start) / 1e9:7.2f} s\n")  # fmt: skip
    if len(ranked) > MAX_ROWS:
        w(f"  ... {len(ranked) - MAX_ROWS} more traces\n")
    w("\nSpans by operation and role:\n")
    for (operation, role), count in sorted(summary.by_operation.items()):
        w(f"  {operation:<10} {role:<16} {count:8}\n")
    if summary.slowest:
        w("\nSlowest task attempts:\n")
        for seconds, name, key, worker in sorted(summary.slowest, reverse=True):
            w(f"  {seconds:8.3f} s  {name:<28} {key[:48]:<48} {worker}\n")
    w(f"\nFailures ({len(summary.failures)}):\n")
    for failure in summary.failures:
        workers = ", ".join(map(str, failure["workers"]))
        w(f"  {failure['name']} {failure['key']}: {failure['exception']}\n")
        w(f"      attempts {failure['attempts']}, on {workers}\n")
    if summary.erred_dependents:
        w(f"  and {summary.erred_dependents} tasks that erred because a dependency did\n")
    if summary.deaths.count:
        post_mortem.render(summary.deaths, summary.failures, out)
    received = summary.metric_total("dask.worker.transfer.received")
    written = summary.metric_total("dask.worker.spill.size", "disk-write")
    read = summary.metric_total("dask.worker.spill.size", "disk-read")
    w(f"\nTransfers: {_mb(received)} received between workers\n")
    w(f"Spilling: {_mb(written)} written to disk, {_mb(read)} read back\n")
    finished = summary.metric_total("dask.task.finished", "memory")
    erred = summary.metric_total("dask.task.finished", "erred")
    w(f"Tasks finished: {finished:.0f} in memory, {erred:.0f} erred\n")
    if summary.severities:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.severities.items()))
        w(f"Log records: {counts}\n")
    biggest = sorted(ranked, key=lambda t: -t[1].spans)[:WATERFALL_TRACES]
    if any(trace.groups for _, trace in biggest):
        w("\nTask groups per trace (scheduler time, creation to final state):\n")
        for trace_id, trace in biggest:
            if trace.groups:
                _waterfall(trace_id, trace, out)
