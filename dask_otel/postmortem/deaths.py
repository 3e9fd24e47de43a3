"""How a worker process died, and what its death leaves behind.

A Nanny (:mod:`dask_otel.plugins.nanny`) notes a :class:`Death` the moment its worker
process ends; :class:`DeathRecord` turns it, with what the worker's flight recorder held
(:mod:`dask_otel.postmortem.flight_recorder`), into a ``dask.worker.died`` log record and, per task
attempt lost, a ``died <prefix>`` span beside that attempt's span, linked to it. Whether
the kernel's OOM killer struck is read from the worker's memory cgroup.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes
from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.trace import Status, StatusCode

from dask_otel import strings
from dask_otel.postmortem import flight_recorder
from dask_otel.spans import ids

if TYPE_CHECKING:
    from dask_otel.config import Settings

#: Signals a process gets for its own faults (a segfault, an abort): a crash.
CRASH_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
    if hasattr(signal, name)
)
#: Longest a log line quoted in a death record, in multiples of otel.max-attribute-length.
LINE_LENGTH_FACTOR = 2


@dataclass(frozen=True)
class MemoryKill:
    """The Nanny's memory monitor terminated a worker process."""

    pid: int
    rss: int
    time_ns: int


@dataclass(frozen=True)
class Death:
    """A worker process that ended: what the Nanny knew at that moment."""

    pid: int
    exitcode: int
    time_ns: int
    worker: str | None
    #: The Nanny asked for it (restart, close), or it was stopped with its Nanny.
    expected: bool
    memory_kill: MemoryKill | None
    #: (time ns, resident bytes), oldest first.
    memory: tuple[tuple[int, int], ...]
    memory_limit: int | None
    terminate_fraction: float | None
    #: The kernel's OOM killer struck in the worker's memory cgroup meanwhile.
    oom_killed: bool

    def signal_number(self) -> int | None:
        return -self.exitcode if self.exitcode < 0 else None

    def cause(self) -> str:
        """``memory``, ``oom-killer``, ``crash``, ``signal`` or ``exit``."""
        number = self.signal_number()
        if self.memory_kill is not None and self.memory_kill.pid == self.pid:
            return "memory"
        if number == signal.SIGKILL and self.oom_killed:
            return "oom-killer"
        if number in CRASH_SIGNALS:
            return "crash"
        return "signal" if number is not None or self.exitcode == 255 else "exit"


def signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class DeathRecord:
    """What one death leaves: a ``dask.worker.died`` log record, and per task attempt the
    worker was executing a ``died <prefix>`` span beside that attempt's span (the
    scheduler's, in the task's trace) with a ``dask.task.lost`` log record in it."""

    def __init__(
        self,
        death: Death,
        wreck: flight_recorder.Wreck | None,
        identity: dict[str, Any],
        settings: Settings,
    ) -> None:
        self.death = death
        self.wreck = wreck
        self.limit = settings.max_attribute_length
        self.log_lines = settings.death_log_lines
        recorded = wreck.identity if wreck is not None else {}
        self.attributes: dict[str, Any] = {
            **{k: v for k, v in recorded.items() if k.startswith("dask.")},
            **identity,
            "process.pid": death.pid,
        }
        if death.worker:
            self.attributes["dask.worker.address"] = death.worker

    def emit(self, otel_logger: Any, tracer: trace.Tracer) -> None:
        death = self.death
        recorded = self.wreck.attempts if self.wreck is not None else []
        attempts = [a for a in recorded if not a.finished]
        attributes = {**self.attributes, **self._cause(), **self._memory()}
        if self.wreck is not None:
            attributes.update(self._recorded(self.wreck))
        died = dict(attributes)
        unreported = [strings.cap(a.key, self.limit) for a in recorded if a.finished]
        if unreported:  # finished, but their spans were never built: lost
            died["dask.task.unreported"] = unreported
        if attempts:
            died["dask.task.keys"] = [strings.cap(a.key, self.limit) for a in attempts]
            placed = (p for p in map(_placed, attempts) if p is not None)
            traces = {f"{parent.trace_id:032x}" for parent, _ in placed}
            if traces:
                died["dask.trace_ids"] = sorted(traces)
        otel_logger.emit(
            LogRecord(
                timestamp=death.time_ns,
                context=_NO_SPAN,
                severity_text="ERROR",
                severity_number=SeverityNumber.ERROR,
                body=self.sentence(attempts),
                attributes=died,
                event_name="dask.worker.died",
            )
        )
        for attempt in attempts:
            self._emit_lost(otel_logger, tracer, attempt, attributes)

    def _emit_lost(
        self,
        otel_logger: Any,
        tracer: trace.Tracer,
        attempt: flight_recorder.Attempt,
        attributes: dict[str, Any],
    ) -> None:
        """The attempt's ``died <prefix>`` span and ``dask.task.lost`` record."""
        placed = _placed(attempt)
        task = {
            "dask.task.key": strings.cap(attempt.key, self.limit),
            "dask.task.prefix": strings.cap(attempt.prefix, self.limit),
            "dask.task.run_id": attempt.run_id,
        }
        why = self._why()
        context = _NO_SPAN
        if placed is not None:
            parent, links = placed
            span = tracer.start_span(
                f"died {task['dask.task.prefix']}",
                context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                start_time=attempt.start_ns,
                attributes={**attributes, **task},
                links=links,
            )
            span.set_status(Status(StatusCode.ERROR, why))
            span.end(self._last_alive(attempt.start_ns))
            context = trace.set_span_in_context(span)
        keep = ("dask.worker.death.cause", "dask.worker.death.signal", "process.exit.code")
        otel_logger.emit(
            LogRecord(
                timestamp=self.death.time_ns,
                context=context,
                severity_text="ERROR",
                severity_number=SeverityNumber.ERROR,
                body=f"Task {task['dask.task.key']} was lost with worker "
                f"{self.death.worker} ({why})",
                attributes={
                    **self.attributes,
                    **{k: attributes[k] for k in keep if k in attributes},
                    **task,
                    "dask.task.start": attempt.start_ns,
                },
                event_name="dask.task.lost",
            )
        )

    def _last_alive(self, start_ns: int) -> int:
        """Where a ``died`` span ends: when the Nanny decided to kill the worker, else its
        last memory reading, else the death. Not the death itself: the scheduler may
        notice the closed connection first and end the ``graph`` span holding it."""
        death = self.death
        kill = death.memory_kill
        if kill is not None and kill.pid == death.pid:
            last = kill.time_ns
        else:
            last = death.memory[-1][0] if death.memory else death.time_ns
        return last if start_ns < last <= death.time_ns else death.time_ns

    def _cause(self) -> dict[str, Any]:
        death = self.death
        attributes: dict[str, Any] = {
            "dask.worker.death.cause": death.cause(),
            "dask.worker.death.description": self._why(),
        }
        number = death.signal_number()
        if number is not None:
            attributes["dask.worker.death.signal"] = signal_name(number)
        else:
            attributes["process.exit.code"] = death.exitcode
        kill = death.memory_kill
        if kill is not None and kill.pid == death.pid:
            attributes["dask.worker.memory.rss_at_kill"] = kill.rss
            attributes["dask.worker.memory.killed_at"] = kill.time_ns
        if death.memory_limit:
            attributes["dask.worker.memory.limit"] = death.memory_limit
        if death.terminate_fraction:
            attributes["dask.worker.memory.terminate_fraction"] = death.terminate_fraction
        return attributes

    def _memory(self) -> dict[str, Any]:
        """The readings before the death: bytes, and when (ns since the epoch)."""
        readings = self.death.memory
        if not readings:
            return {}
        return {
            "dask.worker.memory.rss": readings[-1][1],
            "dask.worker.memory.history": [rss for _, rss in readings],
            "dask.worker.memory.history_times": [t for t, _ in readings],
        }

    def _recorded(self, wreck: flight_recorder.Wreck) -> dict[str, Any]:
        lines = [
            _line(values, self.limit * LINE_LENGTH_FACTOR)
            for values in wreck.last_logs(self.log_lines)
        ]
        attributes: dict[str, Any] = {
            "dask_otel.recovered.spans": len(wreck.unexported_spans),
            "dask_otel.recovered.logs": len(wreck.unexported_logs),
        }
        if lines:
            attributes["dask.worker.last_logs"] = lines
        lost = wreck.spans.lost() + wreck.logs.lost()
        if lost:
            attributes["dask_otel.lost"] = lost  # overwritten, or too large for the recorder
        return attributes

    def _why(self) -> str:
        death = self.death
        cause = death.cause()
        if cause == "memory":
            kill = death.memory_kill
            assert kill is not None
            limit = format_bytes(death.memory_limit) if death.memory_limit else "?"
            fraction = f"{(death.terminate_fraction or 0) * 100:.0f}%"
            return (
                f"terminated by its Nanny: {format_bytes(kill.rss)} of its {limit} memory "
                f"limit, over the {fraction} terminate threshold"
            )
        name = signal_name(death.signal_number())
        if cause == "oom-killer":
            return "killed by the kernel's OOM killer (SIGKILL)"
        if cause == "crash":
            return f"crashed ({name})"
        if cause == "signal":
            return f"killed by {name}" if name else "killed by an unknown signal"
        return f"exited with status {death.exitcode}"

    def sentence(self, attempts: list[flight_recorder.Attempt]) -> str:
        death = self.death
        text = f"Worker {death.worker} (pid {death.pid}) died: {self._why()}"
        if len(death.memory) > 1:
            first, last = death.memory[0], death.memory[-1]
            text += (
                f"; memory {format_bytes(first[1])} -> {format_bytes(last[1])} over the last "
                f"{(last[0] - first[0]) / 1e9:.1f} s"
            )
        if attempts:
            keys = ", ".join(strings.cap(a.key, self.limit) for a in attempts)
            text += f"; executing {keys}"
        return text


#: A context with no span: a record emitted from the emitter thread names no trace.
_NO_SPAN = trace.set_span_in_context(trace.INVALID_SPAN)


def _placed(attempt: flight_recorder.Attempt) -> tuple[trace.SpanContext, list[trace.Link]] | None:
    """(parent, links) of a lost attempt's ``died`` span, from the annotation the attempt
    started with: beside the scheduler's ``attempt`` span (which it emits for a thinned
    task too, at the time of the loss: too late to hold the attempt), under the same
    ``graph`` span and linked to it; with no dask-otel scheduler, under the submitting
    client's span. None if nothing of the task is traced."""
    carrier = ids.parse(attempt.annotation)
    if carrier is None:
        return None
    if carrier.from_client:
        return (carrier.context, []) if carrier.context.trace_flags.sampled else None
    span_id = attempt.span_id if attempt.span_id is not None else carrier.span_id(attempt.key)
    lost = trace.SpanContext(
        carrier.context.trace_id, span_id, True, trace.TraceFlags(trace.TraceFlags.SAMPLED)
    )
    return ids.with_sampled(carrier.context, True), [trace.Link(lost, {"dask.link": "attempt"})]


def _line(entry: tuple, limit: int) -> str:
    """One of the worker's log records as a line: time, severity, body."""
    _, values = entry
    timestamp, _, _, _, _, severity, _, body, _, _ = values
    seconds = (timestamp or 0) / 1e9
    when = datetime.fromtimestamp(seconds, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    return strings.cap(f"{when} {severity or ''} {body}", limit)


# -- the kernel's OOM killer ----------------------------------------------------------------


def oom_kill_counter(pid: int) -> tuple[Path, int] | None:
    """(file, count) of OOM kills in the memory cgroup of ``pid`` (cgroup v2 or v1)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates += [Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events")]
        elif "memory" in controllers.split(","):
            candidates += [Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")]
    candidates += [
        Path("/sys/fs/cgroup/memory.events"),
        Path("/sys/fs/cgroup/memory/memory.oom_control"),
    ]
    for candidate in candidates:
        count = read_oom_kills(candidate)
        if count is not None:
            return candidate, count
    return None


def read_oom_kills(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None
