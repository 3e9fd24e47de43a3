"""The client side: a ``compute <name>`` span from every graph submission until its
results are ready, named after what the user ran (:mod:`dask_otel.spans.naming`).

``Client._graph_to_futures`` is the one path behind compute, persist, submit, map and
get. The span's context rides to the scheduler as a global annotation, the one channel
a plain scheduler passes on to workers; dask-otel's scheduler takes it out of the message
before Dask reads the annotations (they stay the user's) and parents the ``graph`` span
to it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import dask
import distributed
from dask.core import flatten
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from wrapt import wrap_function_wrapper

from dask_otel import runtime, strings
from dask_otel.config import Settings
from dask_otel.plugins import collection_names, unanswered
from dask_otel.plugins.activation import activate
from dask_otel.runtime import report_once
from dask_otel.runtime_state import ProcessState
from dask_otel.spans import errors, ids, naming

logger = logging.getLogger(__name__)

#: Holders of the patch on ``Client._graph_to_futures`` in this process, by what they
#: trace: ``ALL`` submissions (the instrumentor), or only those made ``IN_TASKS`` while a
#: task's span is current (each worker plugin: subtasks, ``worker_client``, join the
#: task's trace; a client the user left uninstrumented stays untraced).
ALL = "all"
IN_TASKS = "in tasks"


class Submissions(ProcessState):
    """Which submissions this process traces, for whom, and the ``compute`` spans still
    waiting for their results (a forked child keeps the patch; its spans are its
    parent's to end)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Callers of :func:`trace_submissions`, by scope.
        self.holders: Counter[str] = Counter()
        #: Compute spans waiting for their results: ended at exit if still open.
        self.waiting: set[trace.Span] = set()

    def forget_parent(self) -> None:
        self.lock = threading.Lock()
        self.waiting = set()


#: The one per process.
submissions = runtime.own(Submissions())


def trace_submissions(scope: str) -> None:
    """Trace clients' submissions in this process (``scope``: ``ALL`` or ``IN_TASKS``)
    until this caller calls :func:`untrace_submissions` with the same scope."""
    with submissions.lock:
        if not submissions.holders:
            wrap_function_wrapper(distributed.Client, "_graph_to_futures", traced_graph_to_futures)
            collection_names.install()
        submissions.holders[scope] += 1


def untrace_submissions(scope: str) -> None:
    holders = submissions.holders
    with submissions.lock:
        holders[scope] -= 1
        if holders[scope] <= 0:
            del holders[scope]
        patched = distributed.Client.__dict__["_graph_to_futures"]
        if not holders and hasattr(patched, "__wrapped__"):
            distributed.Client._graph_to_futures = patched.__wrapped__
            collection_names.uninstall()


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
    try:
        if started is None:
            return wrapped(*args, **kwargs)
        futures = _submit_traced(wrapped, args, kwargs, *started)
        _end_when_ready(client, futures, started[0])
        return futures
    except BaseException as e:
        errors.hide_frame(e)
        raise


def _submit_traced(
    wrapped: Any, args: Any, kwargs: Any, span: trace.Span, settings: Settings
) -> Any:
    """The submission in its ``compute`` span, whose context rides as the annotation; a
    submission that failed ends it."""
    token = context.attach(trace.set_span_in_context(span))
    try:
        carrier = ids.Carrier(span.get_span_context(), from_client=True)
        with dask.annotate(**{ids.ANNOTATION: carrier.encode()}):
            return wrapped(*args, **kwargs)
    except BaseException as e:
        errors.hide_frame(e)
        _record_failure(span, e, settings)
        _end(span)
        raise
    finally:
        context.detach(token)


def _end_when_ready(client: Any, futures: Any, span: trace.Span) -> None:
    """End ``span`` once every result it asked for is ready, erred or released: the
    scheduler's ``graph`` span, its child, lasts as long (a child never outlasts its
    parent). Waits on the client's event loop, no thread."""
    try:
        states = [client.futures.get(key) for key in futures]
        pending = [state for state in states if state is not None and not state.done()]
        if pending:
            if not submissions.waiting:  # after the providers exist: its exit step first
                runtime.at_exit("build", _end_waiting)
            submissions.waiting.add(span)
            client.loop.add_callback(_end_after, pending, span)
            return
    except Exception as e:
        report_once(logger, f"client wait: {e}", "dask-otel: compute spans end at once: %s", e)
    _end(span)


async def _end_after(states: list[Any], span: trace.Span) -> None:
    """Wait for each state not done yet: most are by the time an earlier one is, and
    Dask's ``wait`` makes a timeout and a coroutine even for one that is."""
    try:
        for state in states:
            if not state.done():
                await state.wait()
    finally:
        _end(span)


def _end_waiting() -> None:
    """At exit: the compute spans whose results never came (the process ends first)."""
    for span in list(submissions.waiting):
        _end(span)


def _end(span: trace.Span) -> None:
    submissions.waiting.discard(span)
    try:
        if span.is_recording():  # not ended yet (at exit and by its waiter, say)
            span.end()
    except Exception as e:
        report_once(logger, f"client: {e}", "dask-otel: cannot end a compute span: %s", e)


def _record_failure(span: trace.Span, e: BaseException, settings: Settings) -> None:
    """The submission failed (a bad key, an unpicklable graph): say why on its span."""
    try:
        errors.record_exception(
            span,
            errors.failure(e),
            settings.max_attribute_length,
            redact=settings.redact_exception_messages,
        )
    except Exception:
        span.set_status(Status(StatusCode.ERROR, type(e).__name__))


#: Said once per process: a user's ``otel`` annotation is in the way.
ANNOTATION_WARNING = "otel annotation"


def _warn_about_annotation() -> None:
    """A user's own ``otel`` annotation would shadow the trace context: say so, once."""
    value = dask.get_annotations().get(ids.ANNOTATION)
    if value is None or not runtime.first_time(ANNOTATION_WARNING):
        return
    logger.warning(
        "dask-otel: the task annotation %r is reserved for dask-otel's trace context; "
        "the one set here (%s) is replaced, and tasks of collections built while it was "
        "set may be left untraced",
        ids.ANNOTATION,
        strings.cap(repr(value), 64),
    )


def _start_span(client: Any, args: Any, kwargs: Any) -> tuple[trace.Span, Settings] | None:
    """The ``compute`` span of this submission and the settings, or None when untraced."""
    if ALL not in submissions.holders and not trace.get_current_span().is_recording():
        return None  # only workers hold the patch, and no task's span is current
    settings = activate("client")
    if settings is None:
        return None
    if not runtime.metric_demand.holding(client):  # until it closes (see MetricDemand)
        runtime.metric_demand.hold(client, _open)
    _warn_about_annotation()
    expr = kwargs["expr"] if "expr" in kwargs else args[0] if args else None
    keys = kwargs["keys"] if "keys" in kwargs else args[1] if len(args) > 1 else ()
    limit = settings.max_attribute_length
    user_names = collection_names.current()  # before Dask's optimization renamed them
    name = naming.listed(user_names, limit) if user_names else None
    name = name or naming.computation_name(keys, _inputs_in(expr), limit)
    attributes: dict[str, Any] = {"dask.client.id": client.id, "dask.graph.keys": len(keys)}
    cluster_id = (getattr(client, "_scheduler_identity", None) or {}).get("id")
    if cluster_id:
        attributes["dask.cluster.id"] = cluster_id
    span = (
        runtime.current()
        .tracer()
        .start_span(f"compute {name or 'graph'}", kind=SpanKind.PRODUCER, attributes=attributes)
    )
    if not span.get_span_context().is_valid:
        return None
    unanswered.watch(client)
    return span, settings


def _open(client: Any) -> bool:
    """Whether a client is still open."""
    return getattr(client, "status", "closed") not in ("closing", "closed")


def _inputs_in(expr: Any) -> Callable[[Hashable], list[Hashable]]:
    """``wrapped`` for :func:`naming.computation_name` from the submitted expression.

    A wrapper key (``dask.compute``'s finalize step) is the output of one of the
    expression's collections (the operands of the ``_ExprSequence`` that ``compute`` and
    ``persist`` submit); its inputs are the first keys of that collection's operands.
    """

    def wrapped(key: Hashable) -> list[Hashable]:
        name = key[0] if isinstance(key, tuple) else key
        sequence = type(expr).__name__.endswith("ExprSequence")
        for collection in _expressions(expr) if sequence else [expr]:
            if _name_of(_first_key(collection)) == name:
                return [k for k in map(_first_key, _expressions(collection)) if k is not None]
        return []

    return wrapped


def _expressions(expr: Any) -> list[Any]:
    """The operands of ``expr`` that are expressions themselves."""
    return [op for op in getattr(expr, "operands", ()) if hasattr(op, "__dask_keys__")]


def _first_key(expr: Any) -> Hashable | None:
    try:
        return next(iter(flatten(expr.__dask_keys__())), None)
    except Exception:  # an expression that cannot list its keys names nothing
        return None


def _name_of(key: Hashable | None) -> Hashable | None:
    return key[0] if isinstance(key, tuple) else key
