"""Nanny plugin: the Nanny as an instrumented role, which examines its worker's death.

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
  queued for export but not sent, read from the worker's flight recorder.

Here: the plugin's hooks, the Nanny's methods it wraps, and the memory readings. The
post-mortem itself (the recorders, their directory, what a death says) is
:mod:`dask_otel.postmortem`: :mod:`dask_otel.postmortem.examiner` does it for the Nanny.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import deque
from collections.abc import Callable
from pathlib import Path
from time import time_ns
from typing import TYPE_CHECKING, Any

import dask.config
import psutil
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import NannyPlugin
from tornado.ioloop import PeriodicCallback

from dask_otel import identity, runtime
from dask_otel.plugins import carried
from dask_otel.plugins.activation import activate
from dask_otel.postmortem.deaths import Death, MemoryKill, oom_kill_counter, read_oom_kills
from dask_otel.postmortem.examiner import Examiner
from dask_otel.runtime import PLUGIN_NAME, report_once
from dask_otel.signals import metrics
from dask_otel.spans import emitter

if TYPE_CHECKING:
    from distributed import Nanny

    from dask_otel.config import Settings

logger = logging.getLogger(__name__)

#: Signals that stop a whole process group (systemd, Ctrl-C): a worker that gets one
#: while its Nanny closes was stopped with it.
STOP_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)
#: How long a Nanny keeps asking for the scheduler's id (``dask.cluster.id``).
IDENTITY_TIMEOUT = 60.0


class DaskOtelNannyPlugin(NannyPlugin):
    """Instruments the Nanny it is added to (pickled to remote Nannies)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, asked: dict[str, Any] | None = None) -> None:
        #: The client's settings it carries (:mod:`dask_otel.plugins.carried`).
        self._asked = asked or {}
        self._watch: WorkerWatch | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"asked": self._asked}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("asked"))  # type: ignore[misc]

    def setup(self, nanny: Nanny) -> None:
        carried.apply_asked(self._asked)
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
        self.settings = settings
        self.examiner = Examiner(nanny.address, providers, settings)
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
        #: The worker process this running Nanny was asked to kill (a restart): it asks
        #: the worker to close, and SIGKILLs it if slow. Only that SIGKILL is explained.
        self._stopping_pid: int | None = None
        self._originals: dict[str, Any] = {}
        self._callback = PeriodicCallback(self._read_memory, self.interval * 1000)
        self._identity: asyncio.Task | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        nanny = self.nanny
        if self.settings.flight_recorder_size:
            self.examiner.open(nanny.pid, self.pid)
        self._wrap("log_event", self._log_event)
        self._wrap("kill", self._kill)
        self._wrap("instantiate", self._instantiate)
        self._wrap("_on_worker_exit_sync", self._on_exit)
        if nanny.handlers.get("kill") == self._originals["kill"]:  # the scheduler's requests
            nanny.handlers["kill"] = nanny.kill
        if nanny.process is not None:  # registered while its worker runs
            nanny.process.on_exit = nanny._on_worker_exit_sync
        identity.hosted.add_nanny(nanny.address, None)
        self._note_worker()
        self._callback.start()
        # Its worker's memory, for the metric thread to send.
        runtime.metric_demand.hold(nanny, metrics.server_running)
        self._identity = asyncio.ensure_future(self._fetch_cluster_id())

    async def close(self) -> None:
        self._closed = True
        self._callback.stop()
        if self._identity is not None:
            self._identity.cancel()
        nanny = self.nanny
        if "kill" in self._originals and nanny.handlers.get("kill") == nanny.kill:
            nanny.handlers["kill"] = self._originals["kill"]
        for name in self._originals:
            nanny.__dict__.pop(name, None)
        self.examiner.close(nanny.is_alive(), nanny.pid, self.pid)
        identity.hosted.remove_nanny(nanny.address)
        runtime.metric_demand.release(nanny)
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
        self.examiner.cluster_known(identity["id"])

    # -- the Nanny's methods, wrapped -------------------------------------------------------

    def _log_event(self, topic: Any, msg: Any) -> Any:
        if topic == "worker-restart-memory" and isinstance(msg, dict):
            self._memory_kill = MemoryKill(
                int(msg.get("pid", -1)), int(msg.get("rss", 0)), time_ns()
            )
        return self._originals["log_event"](topic, msg)

    async def _kill(self, *args: Any, **kwargs: Any) -> Any:
        self._stopping_pid = self.nanny.pid
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
            self._oom_kills = oom_kill_counter(pid)
        if self.worker != self.nanny.worker_address:  # known once the worker is up
            self.worker = self.nanny.worker_address
            identity.hosted.add_nanny(self.nanny.address, self.worker)

    def _read_memory(self) -> None:
        if self.nanny.pid != self.pid or self.worker is None:
            self._note_worker()
        rss = self.memory.read(self.pid)
        # A point names its cluster: none before the worker has registered (the reading
        # is still kept for the post-mortem).
        if rss is not None and "dask.cluster.id" in self.attributes:
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

    # -- a death, as the Nanny sees it ----------------------------------------------------

    def _died(self, exitcode: int) -> None:
        """On the event loop, as the Nanny learns that its worker process ended: note
        what only this moment knows, and do the rest in the background."""
        pid = self.pid
        assert pid is not None
        nanny = self.nanny
        # Not a death to explain: a process that exited with 0, one its Nanny SIGKILLed
        # as it stopped it (closing, with dask-otel's plugin or after its removal, or a
        # restart), or the signal that is stopping the Nanny too (its process group). A
        # worker that dies otherwise while being stopped died of its own cause (its Nanny
        # may even have begun to close after the scheduler heard of that death).
        nanny_stops = nanny.status.name not in ("running", "starting")
        closing = self._closed or nanny_stops
        killed = -exitcode == signal.SIGKILL and (nanny_stops or self._stopping_pid == pid)
        expected = exitcode == 0 or killed or (closing and -exitcode in STOP_SIGNALS)
        oom_killed = False
        if self._oom_kills is not None:
            counter, before = self._oom_kills
            after = read_oom_kills(counter)
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
        self.examiner.died(death, {**self.attributes})
