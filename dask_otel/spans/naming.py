"""What a computation is called: after the collection or function the user ran.

A trace is named after its root span. ``compute mean`` says what ran, where the first
requested key's prefix says ``finalize-hlgfinalizecompute`` (the step ``dask.compute``
wraps around a collection) or ``mean_agg-aggregate`` (a reduction's last layer). The
client (which sees the submitted expression) and the scheduler (which sees the tasks)
name a computation alike, through :func:`computation_name`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from itertools import islice
from typing import Any

from dask.utils import key_split

from dask_otel.strings import cap

#: Requested keys, and keys inside a wrapper, looked at: enough to name a computation,
#: bounded for graphs of a million keys.
LOOK_AT = 64
#: Names listed; more are counted (``inc, mean, sum +2``).
MAX_NAMES = 3
#: Prefixes of the steps Dask adds around the user's collections on submission: the
#: finalize step of ``dask.compute`` (arrays, bags, delayed) and the one of a DataFrame.
WRAPPERS = ("finalize", "repartitiontofewer")
#: What Dask's reductions append to the operation's name (``mean_agg-aggregate``,
#: ``sum-tree``, ``mean_aggregate``).
REDUCTION_SUFFIXES = (
    "-aggregate", "-combine", "-partial", "-chunk", "-tree",
    "_aggregate", "_agg", "_combine", "_chunk",
)  # fmt: skip


def is_wrapper(prefix: str) -> bool:
    """Whether a key with this prefix is a step Dask wrapped around the user's work."""
    return prefix.startswith(WRAPPERS)


def operation(prefix: str) -> str:
    """The user's operation in a key prefix: ``mean`` for ``mean_agg-aggregate``."""
    name = prefix
    stripped = True
    while stripped:
        stripped = False
        for suffix in REDUCTION_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name, stripped = name[: -len(suffix)], True
    return name


def computation_name(
    keys: Iterable[Hashable], wrapped: Callable[[Hashable], Iterable[Hashable]], limit: int
) -> str | None:
    """``mean``, ``inc``, ``inc, sum``: the operations behind the requested ``keys``, at
    most ``limit`` characters; None without keys.

    ``wrapped(key)`` gives the keys a wrapper key (see :data:`WRAPPERS`) was made of: the
    user's collections. Names are sorted, so that every process agrees whatever the order
    of ``keys``.
    """
    names: set[str] = set()
    for key in islice(keys, LOOK_AT):
        prefix = key_split(key)
        inner = [key_split(k) for k in islice(wrapped(key), LOOK_AT)] if is_wrapper(prefix) else []
        names.update(operation(p) for p in inner or [prefix])
    return listed(names, limit)


def listed(names: Iterable[str], limit: int) -> str | None:
    """``inc, mean, sum +2``: the distinct ``names`` sorted, the first :data:`MAX_NAMES`
    of them, in at most ``limit`` characters; None without names."""
    shown = sorted(set(names))
    if not shown:
        return None
    text = ", ".join(shown[:MAX_NAMES])
    if len(shown) > MAX_NAMES:
        text += f" +{len(shown) - MAX_NAMES}"
    return cap(text, limit)


def graph_name(keys: Iterable[Hashable], tasks: Mapping[Hashable, Any], limit: int) -> str:
    """The scheduler's name of a ``graph`` span that roots its trace: ``graph mean``.

    ``tasks`` is the scheduler's ``TaskState`` of every key: a wrapper's dependencies are
    what it wraps.
    """

    def wrapped(key: Hashable) -> Iterable[Hashable]:
        state = tasks.get(key)
        return (dependency.key for dependency in state.dependencies) if state else ()

    name = computation_name(keys, wrapped, limit)
    return f"graph {name}" if name else "graph"
