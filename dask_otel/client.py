"""The client side: a ``compute <name>`` span around every graph submission.

``Client._graph_to_futures`` is the one path behind compute, persist, submit, map and
get. The span's context rides to the scheduler as a global annotation, the only channel
``update_graph`` gives plugins; the scheduler parents the ``graph`` span to it.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import dask
from dask.utils import key_split
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from dask_otel import errors, ids, telemetry
from dask_otel.activation import activate
from dask_otel.config import Settings
from dask_otel.report import report_once

logger = logging.getLogger(__name__)

#: Whether this process was told once that a user's ``otel`` annotation is in the way.
_warned_annotation = False


def traced_graph_to_futures(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
    """wrapt wrapper of ``Client._graph_to_futures(expr, keys, span_metadata, ...)``.

    Whatever goes wrong with telemetry (bad settings, a failing SpanProcessor), the
    submission itself goes ahead unchanged.
    """
    try:
        started = _start_span(client, args, kwargs)
    except Exception as e:
        report_once(
            logger, f"client: {e}", "dask-otel: not tracing this client's submissions: %s", e
        )
        started = None
    if started is None:
        return wrapped(*args, **kwargs)
    span, settings = started
    token = context.attach(trace.set_span_in_context(span))
    try:
        with dask.annotate(**{ids.ANNOTATION: ids.encode(span.get_span_context())}):
            return wrapped(*args, **kwargs)
    except BaseException as e:
        _record_failure(span, e, settings)
        raise
    finally:
        context.detach(token)
        try:
            span.end()
        except Exception as e:
            report_once(logger, f"client: {e}", "dask-otel: cannot end a compute span: %s", e)


def _record_failure(span: trace.Span, e: BaseException, settings: Settings) -> None:
    """The submission failed (a bad key, an unpicklable graph): say why on its span."""
    try:
        traceback_text = "".join(traceback.format_tb(e.__traceback__))
        errors.record_exception(
            span,
            e,
            None,
            traceback_text,
            settings.max_attribute_length,
            redact=settings.redact_exception_messages,
        )
    except Exception:
        span.set_status(Status(StatusCode.ERROR, type(e).__name__))


def _warn_about_annotation() -> None:
    """A user's own ``otel`` annotation would shadow the trace context: say so, once."""
    global _warned_annotation
    value = dask.get_annotations().get(ids.ANNOTATION)
    if value is None or _warned_annotation:
        return
    _warned_annotation = True
    logger.warning(
        "dask-otel: the task annotation %r is reserved for dask-otel's trace context; "
        "the one set here (%s) is replaced, and tasks of collections built while it was "
        "set may be left untraced",
        ids.ANNOTATION,
        ids.cap(repr(value), 64),
    )


def _start_span(client: Any, args: Any, kwargs: Any) -> tuple[trace.Span, Settings] | None:
    """The ``compute`` span of this submission and the settings, or None when untraced."""
    settings = activate("client")
    if settings is None:
        return None
    _warn_about_annotation()
    keys = kwargs["keys"] if "keys" in kwargs else args[1] if len(args) > 1 else ()
    first = next(iter(keys), None)
    # A key with no recognisable prefix is its own prefix: cap it like any other string.
    name = (
        ids.cap(key_split(first), settings.max_attribute_length) if first is not None else "graph"
    )
    attributes: dict[str, Any] = {"dask.client.id": client.id, "dask.graph.keys": len(keys)}
    cluster_id = (getattr(client, "_scheduler_identity", None) or {}).get("id")
    if cluster_id:
        attributes["dask.cluster.id"] = cluster_id
    span = (
        telemetry.current()
        .tracer()
        .start_span(f"compute {name}", kind=SpanKind.PRODUCER, attributes=attributes)
    )
    return (span, settings) if span.get_span_context().is_valid else None
