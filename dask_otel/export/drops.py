"""Spans and log records lost in this process, counted and said.

They are lost in two places, both silently as far as a collector can tell: a queue that
is full drops the new item, and an exporter whose retries failed returns FAILURE (the
SDK's batch processors ignore it). dask-otel's export queues count both here, the
``dask_otel.exporter.dropped`` counter reports them, and the log says so once a signal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from dask_otel import identity, runtime
from dask_otel.runtime import report_once

logger = logging.getLogger(__name__)

# The OTLP exporters log every failed attempt (with the collector down, a few lines a
# second per signal and process). Where the program configured no handler, Python prints
# them on stderr as its last resort, where plain Dask prints nothing (a Nanny's worker
# forwards them to the client; distributed's tests read stderr): they reach the handlers a
# program configured, and only those. What is lost is said here, once.
logging.getLogger("opentelemetry.exporter.otlp").addHandler(logging.NullHandler())


#: Spans and log records lost in this process, by (signal, reason).
_dropped: Counter[tuple[str, str]] = Counter()
_dropped_lock = threading.Lock()

#: Always reported (zero included), so the first loss shows as an increase.
_DROP_REASONS = ("queue_full", "export_failed")
NOUNS = {"traces": "spans", "logs": "log records"}
_ADVICE = {
    "queue_full": "its export queue was full (raise {queue}, or check that the collector keeps up)",
    "export_failed": "the exporter gave up on a batch (is the collector reachable, and does "
    "it accept messages this large?)",
    "already_shutdown": "they were made after the SDK shut down",
}
_QUEUE_VARIABLES = {"traces": "OTEL_BSP_MAX_QUEUE_SIZE", "logs": "OTEL_BLRP_MAX_QUEUE_SIZE"}
#: Signals whose losses were reported (checked before the lock: one set lookup a batch).
warned: set[str] = set()


def dropped() -> dict[tuple[str, str], int]:
    """Spans and log records lost so far in this process, by ``(signal, reason)``."""
    with _dropped_lock:
        return dict(_dropped)


def count_dropped(signal: str, reason: str, count: int) -> None:
    """Count lost items. Cheap: called by a batch processor for each item it drops."""
    with _dropped_lock:
        _dropped[signal, reason] += count


@contextlib.contextmanager
def counted_apart() -> Iterator[None]:
    """Count losses in a counter of their own while this lasts, then in the process's
    again (for tests: the loss said once names the totals counted, so one test's losses
    would change what another's message says)."""
    global _dropped
    with _dropped_lock:
        kept, _dropped = _dropped, Counter()
    try:
        yield
    finally:
        with _dropped_lock:
            _dropped = kept


def warn_dropped(signal: str) -> None:
    """Say once per signal (in the exporting thread, off the hot path) what was lost."""
    if f"dropped {signal}" in warned:
        return
    with _dropped_lock:
        lost = {reason: n for (s, reason), n in _dropped.items() if s == signal and n}
    if not lost:
        return
    warned.add(f"dropped {signal}")
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
    cluster = identity.attributes.get("dask.cluster.id")
    named = {"dask.cluster.id": cluster} if cluster is not None else {}
    return [
        Observation(count, {**named, "dask_otel.signal": signal, "error.type": reason})
        for (signal, reason), count in sorted(counts.items())
    ]


def _forget_parent() -> None:
    """In a forked child: the lock is free (a thread of the parent may have held it at the
    fork, reading the counts, and is not here), and the parent's losses are the parent's
    to count and say."""
    global _dropped_lock, _dropped
    _dropped_lock = threading.Lock()
    _dropped = Counter()
    warned.clear()


runtime.forget_in_child(_forget_parent)


def register_dropped_counter() -> None:
    """The ``dask_otel.exporter.dropped`` counter, on the meter provider just configured."""
    from dask_otel.signals.instruments import DROPPED, INSTRUMENTS
    from dask_otel.version import __version__

    spec = INSTRUMENTS[DROPPED]
    meter = metrics.get_meter_provider().get_meter(runtime.SCOPE, __version__)
    meter.create_observable_counter(
        DROPPED, callbacks=[_observe_dropped], unit=spec.unit, description=spec.description
    )
