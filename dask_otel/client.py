"""The client side: a ``compute <name>`` span around every graph submission.

``Client._graph_to_futures`` is the one path behind compute, persist, submit, map and
get. The span's context rides to the scheduler as a global annotation, the only channel
``update_graph`` gives plugins; the scheduler parents the ``graph`` span to it.
"""

from __future__ import annotations

import logging
from typing import Any

import dask
from dask.utils import key_split
from opentelemetry.trace import SpanKind

from dask_otel import ids, telemetry
from dask_otel.activation import activate
from dask_otel.config import ConfigError

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def traced_graph_to_futures(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
    """wrapt wrapper of ``Client._graph_to_futures(expr, keys, span_metadata, ...)``."""
    try:
        settings = activate("client")
    except ConfigError as e:
        _warn_once(e)
        settings = None
    if settings is None:
        return wrapped(*args, **kwargs)
    keys = kwargs["keys"] if "keys" in kwargs else args[1] if len(args) > 1 else ()
    first = next(iter(keys), None)
    name = key_split(first) if first is not None else "graph"
    attributes: dict[str, Any] = {"dask.client.id": client.id, "dask.graph.keys": len(keys)}
    cluster_id = (getattr(client, "_scheduler_identity", None) or {}).get("id")
    if cluster_id:
        attributes["dask.cluster.id"] = cluster_id
    tracer = telemetry.current().tracer()
    with tracer.start_as_current_span(
        f"compute {name}", kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        span_context = span.get_span_context()
        if not span_context.is_valid:
            return wrapped(*args, **kwargs)
        with dask.annotate(**{ids.ANNOTATION: ids.encode(span_context)}):
            return wrapped(*args, **kwargs)


def _warn_once(error: ConfigError) -> None:
    """A bad ``otel.*`` value must not fail the user's submission: say so once."""
    if str(error) not in _warned:
        _warned.add(str(error))
        logger.error("dask-otel: not tracing this client's submissions: %s", error)
