"""Spans and log records lost in this process, counted and said.

They are lost in two places, both silently as far as a collector can tell: a queue that
is full drops the new item, and an exporter whose retries failed returns FAILURE (the
SDK's batch processors ignore it). dask-otel's export queues count both here, the
``dask_otel.exporter.dropped`` counter reports them, and the log says so once a signal.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from dask_otel import identity, runtime
from dask_otel.runtime import report_once
from dask_otel.runtime_state import ProcessState

logger = logging.getLogger(__name__)

# The OTLP exporters log every failed attempt (with the collector down, a few lines a
# second per signal and process). Where the program configured no handler, Python prints
# them on stderr as its last resort, where plain Dask prints nothing (a Nanny's worker
# forwards them to the client; distributed's tests read stderr): they reach the handlers a
# program configured, and only those. What is lost is said here, once.
logging.getLogger("opentelemetry.exporter.otlp").addHandler(logging.NullHandler())


#: Always reported (zero included), so the first loss shows as an increase.
_DROP_REASONS = ("queue_full", "export_failed")
NOUNS = {"traces": "spans", "logs": "log records"}
_ADVICE = {
    "queue_full": "its export queue was full (raise {queue}, or check that the collector keeps up)",
    "export_failed": "the exporter gave up on a batch (is the collector reachable, and does "
    "it accept messages this large?)",
    "already_shutdown": "they were made after the SDK shut down",
    "worker_died": "their worker died before it exported them, and its flight recorder "
    "did not hold them (raise otel.nanny.flight-recorder)",
}
_QUEUE_VARIABLES = {"traces": "OTEL_BSP_MAX_QUEUE_SIZE", "logs": "OTEL_BLRP_MAX_QUEUE_SIZE"}


class Losses(ProcessState):
    """Spans and log records lost in this process, and which signals' losses were said."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Lost so far, by (signal, reason).
        self._counts: Counter[tuple[str, str]] = Counter()
        #: Signals whose losses were said (checked before the lock: one lookup a batch).
        self.said: set[str] = set()

    def count(self, signal: str, reason: str, count: int) -> None:
        with self._lock:
            self._counts[signal, reason] += count

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def forget_parent(self) -> None:
        """The lock is free (a thread of the parent may have held it at the fork, reading
        the counts, and is not here), and the parent's losses are the parent's to count
        and say."""
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
        self.said.clear()


#: The one per process.
losses = runtime.own(Losses())


def dropped() -> dict[tuple[str, str], int]:
    """Spans and log records lost so far in this process, by ``(signal, reason)``."""
    return losses.counts()


def count_dropped(signal: str, reason: str, count: int) -> None:
    """Count lost items. Cheap: called by a batch processor for each item it drops."""
    losses.count(signal, reason, count)


def warn_dropped(signal: str) -> None:
    """Say once per signal (in the exporting thread, off the hot path) what was lost."""
    if signal in losses.said:
        return
    lost = {reason: n for (s, reason), n in losses.counts().items() if s == signal and n}
    if not lost:
        return
    losses.said.add(signal)
    reasons = "; ".join(
        f"{n} because {_ADVICE.get(reason, reason)}".format(queue=_QUEUE_VARIABLES[signal])
        for reason, n in sorted(lost.items())
    )
    report_once(
        logger,
        f"dropped {signal}",
        "dask-otel: %s lost: %s. Said once: from now on losses are only counted, in the "
        "dask_otel.exporter.dropped metric",
        NOUNS[signal],
        reasons,
    )


def _observe_dropped(options: CallbackOptions) -> list[Observation]:
    counts = dropped()
    for signal in NOUNS:
        for reason in _DROP_REASONS:
            counts.setdefault((signal, reason), 0)
    # A scheduler or worker in this process names the cluster its losses belong to.
    cluster = identity.hosted.attributes.get("dask.cluster.id")
    named = {"dask.cluster.id": cluster} if cluster is not None else {}
    return [
        Observation(count, {**named, "dask_otel.signal": signal, "error.type": reason})
        for (signal, reason), count in sorted(counts.items())
    ]


def register_dropped_counter() -> None:
    """The ``dask_otel.exporter.dropped`` counter, on the meter provider just configured."""
    from dask_otel.signals.instruments import DROPPED, INSTRUMENTS
    from dask_otel.version import __version__

    spec = INSTRUMENTS[DROPPED]
    meter = metrics.get_meter_provider().get_meter(runtime.SCOPE, __version__)
    meter.create_observable_counter(
        DROPPED, callbacks=[_observe_dropped], unit=spec.unit, description=spec.description
    )
