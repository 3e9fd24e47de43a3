"""The Nanny's end of the post-mortem: its directory of flight recorders, and what it
sends of the workers that died.

A Nanny makes a directory for its workers' recorders (:mod:`.folders`), labelled with
where it exports (:mod:`.labels`). When a worker process ends without closing, the
Nanny reads its recorder (:mod:`.flight_recorder`), exports what the worker had queued
but not sent, and, for a death it did not ask for, says how the worker died and what it
lost (:mod:`.deaths`). It also sends what the dead workers of Nannies that are gone left
behind, where that telemetry is its to send. All of it runs on the span emitter's thread,
never on the Nanny's event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from dask_otel import runtime
from dask_otel.postmortem import flight_recorder, folders, labels
from dask_otel.postmortem.deaths import Death, DeathRecord
from dask_otel.runtime import report_once
from dask_otel.spans import emitter
from dask_otel.version import __version__

if TYPE_CHECKING:
    from dask_otel.config import Settings

logger = logging.getLogger(__name__)


class Examiner:
    """One Nanny's post-mortems, from its setup (:meth:`open`) to its teardown
    (:meth:`close`)."""

    def __init__(self, address: str, providers: runtime.Providers, settings: Settings) -> None:
        #: The Nanny's address, which names its directory.
        self.address = address
        self.providers = providers
        self.settings = settings
        self.folder = folders.directory(address)
        self._logger = providers.logger_provider.get_logger(f"{runtime.SCOPE}.nanny", __version__)
        #: This Nanny's mark on its flight recorders' directory (None: not made).
        self._mark: str | None = None
        #: Whose directory it is: what others' it may send (its cluster joins when known).
        self.label = labels.Label(labels.destination())
        self._closed = False

    def open(self, *spared: int | None) -> None:
        """Make this Nanny's directory of flight recorders, and send what the dead workers
        of Nannies that are gone left there, if they are of this cluster or export where
        this Nanny does (:mod:`dask_otel.postmortem.labels`). ``spared``: pids of worker
        processes that may still be alive."""
        folder = self.folder
        # An earlier Nanny's at this address: another cluster's stays that cluster's.
        if folders.private(folder) and not self.label.adopts(labels.read(folder)):
            folders.set_aside(folder)
        try:
            self._mark = folders.own(folder)
            labels.write(folder, self.label)
        except OSError as e:
            logger.warning("dask-otel: this Nanny's workers keep no flight recorder: %s", e)
            return
        self.examine_remains(*spared)  # left by an earlier Nanny at this address
        self._adopt_orphans()

    def cluster_known(self, cluster_id: str) -> None:
        """The scheduler's id is known: the directory's label names the cluster, and the
        remains of this cluster's Nannies that export elsewhere become this one's."""
        if self._mark is None or self._closed:
            return
        self.label = dataclasses.replace(self.label, cluster=cluster_id)
        with contextlib.suppress(OSError):
            labels.write(self.folder, self.label)
        self._adopt_orphans()

    def close(self, worker_alive: bool, *spared: int | None) -> None:
        """The Nanny closes: what dead workers left is sent; the directory goes once no
        worker of this Nanny's is alive (else after the last one's post-mortem)."""
        self._closed = True
        self.examine_remains(*spared)
        if not worker_alive:
            emitter.shared().submit(folders.disown, self.folder, self._mark)

    def died(self, death: Death, attributes: dict[str, Any]) -> None:
        """The worker process watched ended: its post-mortem, in the background."""
        emitter.shared().submit(self._post_mortem, death, attributes)

    def examine_remains(self, *spared: int | None) -> None:
        """Export what recorders of dead worker processes still hold, and delete them,
        except those of ``spared`` (dead, maybe, but their exit not handled yet)."""
        for path in _dead_recorders(self.folder, *spared):
            emitter.shared().submit(self._recover, path)

    def _adopt_orphans(self) -> None:
        """Clean up after the Nannies that are gone whose remains this one may send."""
        for folder in folders.orphans(self.folder):
            if self.label.adopts(labels.read(folder)):
                emitter.shared().submit(self._clean_up_after, folder)

    def _clean_up_after(self, folder: Path) -> None:
        """In the background: what the dead workers of a Nanny that is gone left, sent,
        and its directory removed (once its workers, which may outlive it, are dead)."""
        mark = folders.mark_of(folder)
        for path in _dead_recorders(folder):
            self._recover(path)
        folders.disown(folder, mark)

    def _recover(self, path: Path) -> flight_recorder.Wreck | None:
        """In the background: export what the recorder at ``path`` held unexported."""
        claimed = folders.claim(path)
        if claimed is None:
            return None
        try:
            wreck = flight_recorder.read(claimed)
        except folders.Foreign as e:  # left where it is, never sent
            report_once(logger, "foreign", "dask-otel: not a flight recorder, skipped: %s", e)
            return None
        with contextlib.suppress(OSError):
            claimed.unlink()
        if wreck is None:
            return None
        from dask_otel.export import drops, recorder_copy

        try:
            recorder_copy.recover(
                self.providers, wreck.objects, wreck.unexported_spans, wreck.unexported_logs
            )
        except Exception as e:  # what looked like a recorder holds garbage
            report_once(logger, "garbage", "dask-otel: a flight recorder not sent: %r", e)
            return None
        # Counted as this process's own losses are, and said once with them.
        for signal, contents in (("traces", wreck.spans), ("logs", wreck.logs)):
            if contents.lost():
                drops.count_dropped(signal, "worker_died", contents.lost())
        return wreck

    def _post_mortem(self, death: Death, attributes: dict[str, Any]) -> None:
        wreck = self._recover(folders.path_of(self.address, death.pid))
        if self._closed:  # the last worker of this Nanny
            folders.disown(self.folder, self._mark)
        if not death.expected:
            record = DeathRecord(death, wreck, attributes, self.settings)
            record.emit(self._logger, self.providers.tracer())


def _dead_recorders(folder: Path, *spared: int | None) -> list[Path]:
    """The recorders in ``folder`` of worker processes that are gone (not ``spared``)."""
    return [
        path
        for pid, path in folders.recorders(folder)
        if pid not in spared and not psutil.pid_exists(pid)
    ]
