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
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dask_otel import ids, telemetry
from dask_otel.activation import activate
from dask_otel.report import report_once

logger = logging.getLogger(__name__)


def traced_graph_to_futures(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
    """wrapt wrapper of ``Client._graph_to_futures(expr, keys, span_metadata, ...)``.

    Whatever goes wrong with telemetry (bad settings, a failing SpanProcessor), the
    submission itself goes ahead unchanged.
    """
    try:
        span = _start_span(client, args, kwargs)
    except Exception as e:
        report_once(
            logger, f"client: {e}", "dask-otel: not tracing this client's submissions: %s", e
        )
        span = None
    if span is None:
        return wrapped(*args, **kwargs)
    token = context.attach(trace.set_span_in_context(span))
    try:
        with dask.annotate(**{ids.ANNOTATION: ids.encode(span.get_span_context())}):
            return wrapped(*args, **kwargs)
    except BaseException as e:
        span.record_exception(e)
        span.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        context.detach(token)
        try:
            span.end()
        except Exception as e:
            report_once(logger, f"client: {e}", "dask-otel: cannot end a compute span: %s", e)


def _start_span(client: Any, args: Any, kwargs: Any) -> trace.Span | None:
    """The ``compute`` span of this submission, or None when it is not traced."""
    if activate("client") is None:
        return None
    keys = kwargs["keys"] if "keys" in kwargs else args[1] if len(args) > 1 else ()
    first = next(iter(keys), None)
    name = key_split(first) if first is not None else "graph"
    attributes: dict[str, Any] = {"dask.client.id": client.id, "dask.graph.keys": len(keys)}
    cluster_id = (getattr(client, "_scheduler_identity", None) or {}).get("id")
    if cluster_id:
        attributes["dask.cluster.id"] = cluster_id
    span = (
        telemetry.current()
        .tracer()
        .start_span(f"compute {name}", kind=SpanKind.PRODUCER, attributes=attributes)
    )
    return span if span.get_span_context().is_valid else None
