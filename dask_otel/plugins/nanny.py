"""Nanny plugin: the Nanny as an instrumented role, and the post-mortem of its worker.

A Nanny supervises one worker process: it restarts it, kills it when its memory passes
the terminate threshold, and is the one process that sees how it ended. With this plugin:

- its log records (``distributed.nanny``, ``distributed.nanny.memory``: memory kills,
  restarts, exit codes and signals) are exported, stamped with ``dask.nanny.address``
  and the ``dask.worker.address`` it supervises;
- it reads its worker's memory at Dask's memory monitor interval: a histogram
  (``dask.nanny.worker.memory``, one point per export, its max the peak) and the last
  readings, kept for the record of a death;
- when the worker process dies without being asked to, it emits a ``dask.worker.died``
  log record: when, why (the memory monitor with its last reading and the limit, the
  OOM killer, a crash, another signal, an exit code), what the worker was executing, its
  memory before, its last log lines; and per attempt lost a ``died <prefix>`` span under
  that attempt's span in the task's trace, with a ``dask.task.lost`` record in it;
- whenever the worker's process ends without closing, it exports what the worker had
  queued for export but not sent, read from the worker's flight recorder
  (:mod:`dask_otel.signals.flight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from time import time_ns
from typing import TYPE_CHECKING, Any

import dask.config
import psutil
from dask.utils import format_bytes, parse_timedelta
from distributed.diagnostics.plugin import NannyPlugin
from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.trace import Status, StatusCode
from tornado.ioloop import PeriodicCallback

from dask_otel import runtime
from dask_otel.plugins.activation import activate
from dask_otel.runtime import PLUGIN_NAME, report_once
from dask_otel.signals import flight, logs, metrics
from dask_otel.spans import emitter, ids
from dask_otel.version import __version__

if TYPE_CHECKING:
    from distributed import Nanny

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: Signals a process gets for its own faults (a segfault, an abort): a crash.
CRASH_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
    if hasattr(signal, name)
)
#: Signals that stop a whole process group (systemd, Ctrl-C): a worker that gets one
#: while its Nanny closes was stopped with it.
STOP_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)
#: Longest a log line quoted in a death record, in multiples of otel.max-attribute-length.
LINE_LENGTH_FACTOR = 2
#: How long a Nanny keeps asking for the scheduler's id (``dask.cluster.id``).
IDENTITY_TIMEOUT = 60.0


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


class DaskOtelNannyPlugin(NannyPlugin):
    """Instruments the Nanny it is added to (pickled to remote Nannies)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._watch: WorkerWatch | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def setup(self, nanny: Nanny) -> None:
        settings = activate("nanny", nanny)
        if settings is None:
            return
        self._watch = WorkerWatch(nanny, runtime.current(), settings)
        self._watch.start()

    async def teardown(self, nanny: Nanny) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.close()


class _MemoryReader:
    """The worker process's resident memory, read as Dask's memory monitor reads it."""

    def __init__(self, history: int) -> None:
        self.readings: deque[tuple[int, int]] = deque(maxlen=max(1, history))
        self._process: psutil.Process | None = None

    def read(self, pid: int | None) -> int | None:
        if pid is None:
            return None
        process = self._process
        try:
            if process is None or process.pid != pid:
                process = self._process = psutil.Process(pid)
                self.readings.clear()  # another worker process
            rss = process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        if not rss:  # a process that is gone but not yet reaped has none
            return None
        self.readings.append((time_ns(), rss))
        return int(rss)


class WorkerWatch:
    """Everything one Nanny does for dask-otel, from setup to teardown.

    Wraps a few of the Nanny's methods on the instance (never the class): ``log_event``
    (the memory monitor announces its kills there), ``kill`` and ``instantiate`` (a
    worker the Nanny stops is not a death; one it starts is the one watched) and the
    worker process's exit callback.
    """

    def __init__(self, nanny: Nanny, providers: runtime.Providers, settings: Settings) -> None:
        self.nanny = nanny
        self.providers = providers
        self.settings = settings
        self.folder = flight.directory(nanny.address)
        self._logger = providers.logger_provider.get_logger(f"{runtime.SCOPE}.nanny", __version__)
        interval = parse_timedelta(
            dask.config.get("distributed.worker.memory.monitor-interval"), default="ms"
        )
        self.interval = interval or 0.1
        self.memory = _MemoryReader(round(settings.memory_history / self.interval))
        meter = metrics.meter_provider(providers, settings)
        self._histogram = metrics.sources(meter).worker_memory
        self.attributes: dict[str, Any] = {"dask.nanny.address": nanny.address}
        #: The worker process watched: its pid and address, noted while it lives.
        self.pid: int | None = None
        self.worker: str | None = None
        self._oom_kills: tuple[Path, int] | None = None
        self._memory_kill: MemoryKill | None = None
        self._expected_pid: int | None = None
        self._originals: dict[str, Any] = {}
        self._callback = PeriodicCallback(self._read_memory, self.interval * 1000)
        self._identity: asyncio.Task | None = None
        self._closed = False
        #: This Nanny's mark on its flight recorders' directory (None: not made).
        self._mark: str | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        nanny = self.nanny
        if self.settings.flight_recorder_size:
            with contextlib.suppress(OSError):
                self._mark = flight.own(self.folder)
            self._examine_remains()  # left by an earlier Nanny at this address
            for folder in flight.orphans(self.folder):  # and by Nannies that are gone
                emitter.shared().submit(self._clean_up_after, folder)
        self._wrap("log_event", self._log_event)
        self._wrap("kill", self._kill)
        self._wrap("instantiate", self._instantiate)
        self._wrap("_on_worker_exit_sync", self._on_exit)
        if nanny.handlers.get("kill") == self._originals["kill"]:  # the scheduler's requests
            nanny.handlers["kill"] = nanny.kill
        if nanny.process is not None:  # registered while its worker runs
            nanny.process.on_exit = nanny._on_worker_exit_sync
        logs.add_nanny(nanny.address, None)
        self._note_worker()
        self._callback.start()
        self._identity = asyncio.ensure_future(self._fetch_cluster_id())

    async def close(self) -> None:
        self._closed = True
        if self.nanny.status.name == "closing":  # it kills its worker next, SIGKILL if slow
            self._expected_pid = self.nanny.pid  # (None if the worker is dead already)
        self._callback.stop()
        if self._identity is not None:
            self._identity.cancel()
        nanny = self.nanny
        if "kill" in self._originals and nanny.handlers.get("kill") == nanny.kill:
            nanny.handlers["kill"] = self._originals["kill"]
        for name in self._originals:
            nanny.__dict__.pop(name, None)
        self._examine_remains()
        if not nanny.is_alive():  # no worker to wait for
            emitter.shared().submit(flight.disown, self.folder, self._mark)
        logs.remove_nanny(nanny.address)
        # The post-mortems in progress reach the export queues, which the process's exit
        # flushes (bounded): not waited for here, with a collector that may be down.
        await emitter.off_loop(emitter.shared().close, self.settings.flush_timeout)

    def _wrap(self, name: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(self.nanny, name)
        self._originals[name] = original
        setattr(self.nanny, name, wrapper)

    async def _fetch_cluster_id(self) -> None:
        try:
            identity = await asyncio.wait_for(
                self.nanny.scheduler.identity(n_workers=0), IDENTITY_TIMEOUT
            )
        except Exception as e:
            logger.warning("dask-otel: cannot read the scheduler's id, records lack it: %r", e)
            return
        self.attributes["dask.cluster.id"] = identity["id"]

    # -- the Nanny's methods, wrapped -------------------------------------------------------

    def _log_event(self, topic: Any, msg: Any) -> Any:
        if topic == "worker-restart-memory" and isinstance(msg, dict):
            self._memory_kill = MemoryKill(
                int(msg.get("pid", -1)), int(msg.get("rss", 0)), time_ns()
            )
        return self._originals["log_event"](topic, msg)

    async def _kill(self, *args: Any, **kwargs: Any) -> Any:
        self._expected_pid = self.nanny.pid
        return await self._originals["kill"](*args, **kwargs)

    async def _instantiate(self, *args: Any, **kwargs: Any) -> Any:
        result = await self._originals["instantiate"](*args, **kwargs)
        self._note_worker()
        return result

    def _note_worker(self) -> None:
        """Watch the worker process running now (started, restarted, or found at setup)."""
        pid = self.nanny.pid
        if pid is None:
            return
        if pid != self.pid:
            self.pid = pid
            self.memory.read(pid)
            self._oom_kills = _oom_kill_counter(pid)
        if self.worker != self.nanny.worker_address:  # known once the worker is up
            self.worker = self.nanny.worker_address
            logs.add_nanny(self.nanny.address, self.worker)

    def _read_memory(self) -> None:
        if self.nanny.pid != self.pid or self.worker is None:
            self._note_worker()
        rss = self.memory.read(self.pid)
        if rss is not None:
            worker = {"dask.worker.address": self.worker} if self.worker else {}
            self._histogram.record(rss, {**self.attributes, **worker})

    def _on_exit(self, exitcode: int) -> Any:
        """Stays the worker process's exit callback after teardown: a worker that dies
        as its Nanny closes (SIGTERM to the process group) still has its records sent."""
        try:
            if self.pid is not None:
                self._died(exitcode)
        except Exception:
            report_once(logger, "nanny", "dask-otel: the post-mortem of a worker failed")
        return self._originals["_on_worker_exit_sync"](exitcode)

    # -- post-mortem ------------------------------------------------------------------------

    def _died(self, exitcode: int) -> None:
        """On the event loop, as the Nanny learns that its worker process ended: note
        what only this moment knows, and do the rest in the background."""
        pid = self.pid
        assert pid is not None
        nanny = self.nanny
        # Not a death to explain: a process that exited with 0, one the Nanny stopped
        # itself, or the signal that is stopping the Nanny too (its process group).
        closing = self._closed or nanny.status.name not in ("running", "starting")
        expected = (
            exitcode == 0 or self._expected_pid == pid or (closing and -exitcode in STOP_SIGNALS)
        )
        oom_killed = False
        if self._oom_kills is not None:
            counter, before = self._oom_kills
            after = _read_oom_kills(counter)
            oom_killed = after is not None and after > before
        manager = nanny.memory_manager
        death = Death(
            pid=pid,
            exitcode=exitcode,
            time_ns=time_ns(),
            worker=self.worker,
            expected=expected,
            memory_kill=self._memory_kill,
            memory=tuple(self.memory.readings),
            memory_limit=manager.memory_limit,
            terminate_fraction=manager.memory_terminate_fraction or None,
            oom_killed=oom_killed,
        )
        self.pid = None
        emitter.shared().submit(self._post_mortem, death, {**self.attributes})

    def _examine_remains(self) -> None:
        """Export what recorders of dead worker processes still hold, and delete them."""
        # Not the recorder of the worker watched: dead, maybe, but its exit not yet
        # handled (the Nanny learns it from a thread, via the event loop).
        for path in _dead_recorders(self.folder, self.nanny.pid, self.pid):
            emitter.shared().submit(self._recover, path)

    def _clean_up_after(self, folder: Path) -> None:
        """In the background: what the dead workers of a Nanny that is gone left, sent,
        and its directory removed (once its workers, which may outlive it, are dead)."""
        mark = flight.mark_of(folder)
        for path in _dead_recorders(folder):
            self._recover(path)
        flight.disown(folder, mark)

    def _recover(self, path: Path) -> flight.Wreck | None:
        """In the background: export what the recorder at ``path`` held unexported."""
        claimed = flight.claim(path)
        if claimed is None:
            return None
        wreck = flight.read(claimed)
        with contextlib.suppress(OSError):
            claimed.unlink()
        if wreck is not None:
            from dask_otel.distro import sdk

            sdk.recover(
                self.providers, wreck.objects, wreck.unexported_spans, wreck.unexported_logs
            )
        return wreck

    def _post_mortem(self, death: Death, attributes: dict[str, Any]) -> None:
        wreck = self._recover(flight.path_of(self.nanny.address, death.pid))
        if self._closed:  # the last worker of this Nanny
            flight.disown(self.folder, self._mark)
        if not death.expected:
            record = DeathRecord(death, wreck, attributes, self.settings)
            record.emit(self._logger, self.providers.tracer())


class DeathRecord:
    """What one death leaves: a ``dask.worker.died`` log record, and per task attempt the
    worker was executing a ``died <prefix>`` span under that attempt's span (the
    scheduler's, in the task's trace) with a ``dask.task.lost`` log record in it."""

    def __init__(
        self,
        death: Death,
        wreck: flight.Wreck | None,
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
        unreported = [ids.cap(a.key, self.limit) for a in recorded if a.finished]
        if unreported:  # finished, but their spans were never built: lost
            died["dask.task.unreported"] = unreported
        if attempts:
            died["dask.task.keys"] = [ids.cap(a.key, self.limit) for a in attempts]
            traces = {f"{c.trace_id:032x}" for c in map(_parent, attempts) if c is not None}
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
        attempt: flight.Attempt,
        attributes: dict[str, Any],
    ) -> None:
        """The attempt's ``died <prefix>`` span and ``dask.task.lost`` record."""
        parent = _parent(attempt)
        task = {
            "dask.task.key": ids.cap(attempt.key, self.limit),
            "dask.task.prefix": ids.cap(attempt.prefix, self.limit),
            "dask.task.run_id": attempt.run_id,
        }
        why = self._why()
        context = _NO_SPAN
        if parent is not None:
            span = tracer.start_span(
                f"died {task['dask.task.prefix']}",
                context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                start_time=attempt.start_ns,
                attributes={**attributes, **task},
            )
            span.set_status(Status(StatusCode.ERROR, why))
            span.end(self.death.time_ns)
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

    def _recorded(self, wreck: flight.Wreck) -> dict[str, Any]:
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
            attributes["dask_otel.lost"] = lost  # overwritten in the recorder before export
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

    def sentence(self, attempts: list[flight.Attempt]) -> str:
        death = self.death
        text = f"Worker {death.worker} (pid {death.pid}) died: {self._why()}"
        if len(death.memory) > 1:
            first, last = death.memory[0], death.memory[-1]
            text += (
                f"; memory {format_bytes(first[1])} -> {format_bytes(last[1])} over the last "
                f"{(last[0] - first[0]) / 1e9:.1f} s"
            )
        if attempts:
            keys = ", ".join(ids.cap(a.key, self.limit) for a in attempts)
            text += f"; executing {keys}"
        return text


#: A context with no span: a record emitted from the emitter thread names no trace.
_NO_SPAN = trace.set_span_in_context(trace.INVALID_SPAN)


def _parent(attempt: flight.Attempt) -> trace.SpanContext | None:
    """The span a lost attempt's ``died`` span hangs under, named from the annotation the
    attempt started with: the scheduler's ``attempt`` span (which it emits for a thinned
    task too), or with ``otel.scheduler.task-spans: all`` the task's ``task`` span (the
    same id); with no dask-otel scheduler, the submitting client's span."""
    carrier = ids.parse(attempt.annotation)
    if carrier is None:
        return None
    if carrier.from_client or carrier.scheduler_spans:
        if not carrier.context.trace_flags.sampled:
            return None  # nothing of this task is traced
        if carrier.from_client:
            return carrier.context
    trace_id, span_id = ids.attempt_span_id(attempt.annotation, attempt.key)  # type: ignore[misc]
    return trace.SpanContext(trace_id, span_id, True, trace.TraceFlags(trace.TraceFlags.SAMPLED))


def _line(entry: tuple, limit: int) -> str:
    """One of the worker's log records as a line: time, severity, body."""
    _, values = entry
    timestamp, _, _, _, _, severity, _, body, _, _ = values
    seconds = (timestamp or 0) / 1e9
    when = datetime.fromtimestamp(seconds, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    return ids.cap(f"{when} {severity or ''} {body}", limit)


def _dead_recorders(folder: Path, *spared: int | None) -> list[Path]:
    """The recorders in ``folder`` of worker processes that are gone (not ``spared``)."""
    return [
        path
        for pid, path in flight.recorders(folder)
        if pid not in spared and not psutil.pid_exists(pid)
    ]


# -- the kernel's OOM killer ----------------------------------------------------------------


def _oom_kill_counter(pid: int) -> tuple[Path, int] | None:
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
        count = _read_oom_kills(candidate)
        if count is not None:
            return candidate, count
    return None


def _read_oom_kills(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None
