"""``dask-otel summarize``: one screen on what a recorded run did and what went wrong.

Reads OTLP JSON lines (``dask-otel demo``'s files, a collector's ``file`` exporter: one
export request a line) from files and directories, streaming them line by line, and
answers: what failed, where and why (with the trace to open), what was slow, what moved
and spilled, per worker, when the task groups ran, the ERROR log records, and what is
missing from the recording. A line that cannot be read (truncated, foreign, hostile) is
skipped and reported; it never ends the summary.

Everything is counted from spans and log records, never from metrics (exported once a
minute, they lag what the spans show). Spans are told apart by name and attributes, not
by which process sent them, so recordings of older releases read alike too:
``execute``/``attempt`` spans and a worker's ``task`` span are attempts; a ``task`` span with
``dask.task.state`` is the scheduler's record of a task; a ``died`` span is an attempt
lost with its worker (beside the scheduler's ``attempt`` span for it, linked).

The lines are read by :mod:`dask_otel.tools.otlp_json`; the screen is written by
:mod:`dask_otel.tools.report`.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dask_otel.tools import post_mortem
from dask_otel.tools.otlp_json import Batch, LogRecord, Span, parse

#: Rows printed per list; the rest is counted.
MAX_ROWS = 8
#: Skipped lines remembered (with why); the rest is counted.
MAX_SKIPPED = 5
#: Severity numbers from ERROR up.
_ERROR_SEVERITY = 17
#: Spans only a scheduler, worker or Nanny makes: a trace with none of them got nothing
#: from the cluster.
_CLUSTER_OPERATIONS = frozenset(
    ("graph", "task", "attempt", "execute", "transfer", "get_data", "spill", "unspill", "died")
)
#: Work on a task's result after the task ended: each span roots a trace of its own.
_RESULT_WORK = ("spill", "unspill")


class SummaryError(Exception):
    """Nothing to summarize: the message says which path and why."""


# -- what the spans say ----------------------------------------------------------------------


@dataclass
class _Task:
    """One task (a key in a trace), from all the spans that name it."""

    prefix: str = ""
    #: Ids of the attempt spans seen, and of those that failed.
    attempt_ids: set[str] = field(default_factory=set)
    failed_ids: set[str] = field(default_factory=set)
    #: The attempts ``died`` spans name (the one they link to, or in recordings of
    #: dask-otel's earlier layout their parent): attempts lost with their worker, which
    #: the scheduler may have reported as an ``attempt`` span too, or not.
    lost: list[str] = field(default_factory=list)
    #: Failed attempts with no run of their own (the scheduler's, lost with their worker).
    unran_ids: set[str] = field(default_factory=set)
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
    def failed_after_running(self) -> bool:
        """A failed attempt is known to have run: its worker reported it, or a Nanny's
        ``died`` span names it. One the scheduler alone says was lost with its worker may
        have been queued there, never started."""
        named = set(self.lost)
        return any(i not in self.unran_ids or i in named for i in self.failed_ids) or any(
            p not in self.attempt_ids for p in named
        )

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
    #: Spans from the cluster's processes (see _CLUSTER_OPERATIONS).
    cluster_spans: int = 0
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
    #: Submissions the client traced: (trace, ``compute`` span id) -> its name.
    computations: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Parents of ``graph`` spans: the computations the scheduler answered.
    answered: set[tuple[str, str]] = field(default_factory=set)
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
        if span.operation in _RESULT_WORK and not span.parent:
            # A trace of its own, linked to the task whose result it moved: a tally of
            # what moved, not a computation to list.
            if span.worker:
                self._add_movement(span)
            return
        if span.parent:
            self.parents.append((span.trace, span.parent))
        trace = self.traces[span.trace]
        trace.spans += 1
        trace.start = min(trace.start or span.start, span.start)
        trace.end = max(trace.end, span.end)
        if not span.parent:
            trace.root, trace.root_role = span.name, span.role
        operation = span.operation
        trace.cluster_spans += operation in _CLUSTER_OPERATIONS
        if operation == "compute" and not span.error:  # a failed submission has no graph
            self.computations[span.trace, span.span_id] = span.name
        elif operation == "graph":
            self.answered.add((span.trace, span.parent))
        if span.key:
            self._add_task_span(span, trace)
        if operation in ("transfer", *_RESULT_WORK) and span.worker:
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
            task.lost.append(span.links.get("attempt") or span.parent)
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
            if not span.ran:
                task.unran_ids.add(span.span_id)
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
        """A spill, an unspill, or a fetch from a peer: received here, sent by the peer
        (counted from the receiving side only: a worker's ``get_data`` serves clients too)."""
        worker = self.workers[span.worker]
        worker.name = worker.name or str(span.attributes.get("dask.worker.name") or "")
        if span.operation in ("spill", "unspill"):
            moved = float(span.attributes.get("dask.spill.bytes") or 0)
            tallies = [worker.spilled if span.operation == "spill" else worker.unspilled]
        else:
            if span.attributes.get("dask.transfer.outcome", "success") != "success":
                return
            moved = float(span.attributes.get("dask.transfer.bytes") or 0)
            peer = str(span.attributes.get("dask.peer.address") or "?")
            _keep_largest(
                self.slowest_transfers, (span.seconds, moved, peer, span.worker, span.trace)
            )
            tallies = [worker.received, self.workers[peer].sent]
        for tally in tallies:
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

    def unanswered(self) -> tuple[list[str], list[str]]:
        """Names of the computations with no ``graph`` span: those whose trace has no span
        from the cluster at all, and the others."""
        silent: list[str] = []
        partial: list[str] = []
        for (trace, span_id), name in self.computations.items():
            if (trace, span_id) not in self.answered:
                heard = self.traces[trace].cluster_spans
                (partial if heard else silent).append(name)
        return silent, partial

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
        if not path.is_dir():  # a file, or what reads as one (/dev/stdin, a pipe)
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
