"""The client's settings that decide what leaves the cluster, carried by the plugins
``dask_otel.instrument(client)`` registers to every process they reach.

A scheduler or worker started on its own reads only its own ``otel.*`` config: a client's
``otel.redact.exception-messages: true`` would otherwise stop at the client. The plugins
carry the settings below that the client changed from dask-otel's defaults, and each
process takes the stricter of its own value and the client's (what lets less leave the
cluster): redaction if either asks, the shorter length cap, the smaller share of tasks
traced. Where a process's own value is the stricter one, the client's does not reach it,
and the client says so once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from dask_otel.plugins import own_runs

# Imported where dask-otel's instrumentor loads (every process opentelemetry-instrument
# starts): Dask's config is imported by each function as it runs.

#: Settings carried: the field of ``dask_otel.config.Settings`` each is read into, and
#: how two values combine into the stricter.
CARRIED: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "otel.redact.exception-messages": ("redact_exception_messages", operator.or_),
    "otel.redact.log-bodies": ("redact_log_bodies", operator.or_),
    "otel.max-attribute-length": ("max_attribute_length", min),
    "otel.task.sample-ratio": ("task_sample_ratio", min),
    "otel.task.max-spans-per-graph": ("max_spans_per_graph", min),
}


def _default(key: str) -> Any:
    from dask_otel.config import DEFAULTS

    value: Any = DEFAULTS
    for part in key.split("."):
        value = value[part]
    return value


def asked() -> dict[str, Any]:
    """The carried settings this process (the client) set otherwise than the defaults,
    as validated values."""
    import dask.config

    from dask_otel.config import load_settings

    changed = [key for key in CARRIED if dask.config.get(key) != _default(key)]
    if not changed:
        return {}
    settings = load_settings()
    return {key: getattr(settings, CARRIED[key][0]) for key in changed}


@own_runs.register
def apply_asked(values: Mapping[str, Any]) -> list[str]:
    """Make this process's carried settings the stricter of its own and ``values`` (the
    client's); the settings (``key: own value``) where its own stays, stricter than the
    client's. Nothing where its own settings are invalid (dask-otel is off there)."""
    import dask.config

    from dask_otel.config import ConfigError, load_settings

    if not values:
        return []
    try:
        own = load_settings()
    except ConfigError:
        return []
    changes: dict[str, Any] = {}
    kept = []
    for key, value in values.items():
        if key not in CARRIED:  # from another version of dask-otel
            continue
        field, stricter = CARRIED[key]
        mine = getattr(own, field)
        merged = stricter(mine, value)
        if merged != mine:
            changes[key] = merged
        if merged != value:
            kept.append(f"{key}: {mine!r}")
    if changes:
        dask.config.set(changes)  # for this whole process, as its own config would
    return kept
