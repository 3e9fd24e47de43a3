"""Letting go of a closed server's metric series.

The SDK keeps every attribute set it has seen, for as long as its meter provider lives,
and exports each at every collection (a cumulative counter at its last value): a process
that runs cluster after cluster (a notebook, a test suite) would keep, and report, every
closed scheduler's and worker's series. Once a server's last collection is done (its
plugin flushed at close), :func:`let_go` removes the series that carry its identity.

The SDK has no public way to forget a series: this reads its storage (the measurement
consumer's reader storages, their view matches and each aggregation's attributes), and
where a release of the SDK keeps them elsewhere it frees nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def let_go(meter_provider: Any, identity: Mapping[str, Any]) -> int:
    """Remove from ``meter_provider`` every series whose attributes hold all of
    ``identity`` (``{"dask.worker.address": ...}``, say); how many were removed."""
    consumer = getattr(meter_provider, "_measurement_consumer", None)
    storages = getattr(consumer, "_reader_storages", None)
    if not identity or not isinstance(storages, dict):
        return 0
    wanted = dict(identity)
    removed = 0
    for storage in list(storages.values()):
        matches_by_instrument = getattr(storage, "_instrument_view_instrument_matches", None)
        if not isinstance(matches_by_instrument, dict):
            continue
        for matches in list(matches_by_instrument.values()):
            for match in matches:
                removed += _remove_matching(match, wanted)
    return removed


def _remove_matching(match: Any, wanted: dict[str, Any]) -> int:
    """Remove the series of one view match whose attributes hold ``wanted``."""
    series = getattr(match, "_attributes_aggregation", None)
    lock = getattr(match, "_lock", None)
    if not isinstance(series, dict) or lock is None:
        return 0
    with lock:
        gone = [key for key, aggregation in series.items() if _holds(aggregation, wanted)]
        for key in gone:
            del series[key]
    return len(gone)


def _holds(aggregation: Any, wanted: dict[str, Any]) -> bool:
    attributes = getattr(aggregation, "_attributes", None) or {}
    return all(attributes.get(name, _ABSENT) == value for name, value in wanted.items())


_ABSENT = object()
