"""HTTP connections a forked child must not share with its parent.

The OTLP/HTTP exporters keep their connections to the collector open between exports (a
``requests.Session``'s pool). A child forked from a process that exported (a worker of a
Nanny started with ``fork``, a task's ``multiprocessing`` pool) inherits those sockets:
both processes then write requests into one connection and read each other's answers,
and the collector rejects the mixed bytes (400 Bad Request, broken reads), losing both
processes' batches. The child closes its copies at the fork; its next export opens a
connection of its own, and the parent's stay open (closing a descriptor in the child
leaves the parent's alone).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

#: How many attributes deep an exporter keeps its session (an exporter wrapped by
#: dask-otel's, holding a transport that holds the session).
DEPTH = 4


def close_inherited(owner: Any) -> None:
    """In a forked child: close the pooled connections of every ``requests.Session``
    reachable from ``owner``'s attributes (the session stays usable)."""
    requests = sys.modules.get("requests")
    if requests is None:  # no HTTP exporter was ever made
        return
    seen: set[int] = set()
    todo = [(owner, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, requests.Session):
            with contextlib.suppress(Exception):
                obj.close()
        elif depth < DEPTH:
            todo.extend((value, depth + 1) for value in getattr(obj, "__dict__", {}).values())
