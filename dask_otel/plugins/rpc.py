"""``rpc <op>`` spans: Dask's request/response messages between processes.

Every outgoing request goes through ``distributed.core.send_recv``, which several modules
import by name: each binding is replaced (:func:`install`). A CLIENT span is recorded when
a traced operation is current (a ``transfer``'s ``get_data`` request, a user's span around
``client.gather``) or the op is listed in ``otel.rpc.always-record``; everything else,
heartbeats above all, costs one check. Handled requests (SERVER spans) are recorded for the
always-recorded ops: no trace context travels in Dask's messages, so a server cannot tell
a traced request from any other.
Nothing nests under a request: the event loop notes its parent, times and attributes, and
this process's emitter thread builds the span.
"""

from __future__ import annotations

import functools
import inspect
import sys
from time import time_ns
from typing import TYPE_CHECKING, Any

from distributed import core
from distributed.comm.addressing import get_address_host_port
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from dask_otel import identity, runtime
from dask_otel.runtime_state import ProcessState
from dask_otel.spans import emitter, errors
from dask_otel.spans.records import DeferredSpan, EndedSpans, ended_spans

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import ModuleType

    from dask_otel.config import Settings

#: ``rpc.system.name`` of every span: Dask's own protocol.
SYSTEM = "dask"

_original_send_recv = core.send_recv


class _Recording:
    """What the patched ``send_recv`` needs; replaced whole so readers see one snapshot."""

    def __init__(self, tracer: trace.Tracer, settings: Settings) -> None:
        self.spans = ended_spans(tracer, settings.max_attribute_length)
        self.always = settings.rpc_always_record
        self.never = settings.rpc_never_record


class RpcPatch(ProcessState):
    """Whether ``rpc`` spans are recorded in this process, and where ``send_recv`` was
    replaced (a forked child keeps both)."""

    def __init__(self) -> None:
        #: What is recorded, while :func:`install` is in force.
        self.recording: _Recording | None = None
        #: The ``distributed`` modules whose ``send_recv`` binding :func:`install` replaced.
        self.patched: list[ModuleType] = []


#: The one per process.
rpc_patch = runtime.own(RpcPatch())


def peer_attributes(address: str | None, prefix: str) -> dict[str, Any]:
    """``<prefix>.address`` and ``<prefix>.port`` of a Dask address, when it has them."""
    if not address:
        return {}
    host, port = _host_port(address)
    if port is None:
        return {f"{prefix}.address": host}
    return {f"{prefix}.address": host, f"{prefix}.port": port}


@functools.lru_cache(maxsize=1024)
def _host_port(address: str) -> tuple[str, int | None]:
    """Parsed once per peer: a cluster talks to the same few addresses all the time."""
    try:
        return get_address_host_port(address)
    except Exception:  # inproc:// and other transports without host and port
        return address, None


def _request(state: _Recording, op: Any, comm: Any) -> tuple[trace.Span, dict] | None:
    """(parent, attributes) of a request's CLIENT span, or None if it is not recorded."""
    if op in state.never or not isinstance(op, str):
        return None
    current = trace.get_current_span()
    if op not in state.always and not current.is_recording():
        return None
    peer = getattr(comm, "peer_address", None)
    # Asked now: a transfer's DeferredSpan draws its id here, before any thread builds.
    current.get_span_context()
    return current, {
        **identity.hosted.attributes,
        "rpc.system.name": SYSTEM,
        "rpc.method": op,
        **peer_attributes(peer, "server"),
        **peer_attributes(peer, "network.peer"),
    }


def send_recv(
    comm: Any,
    *,
    reply: bool = True,
    serializers: Any = None,
    deserializers: Any = None,
    **kwargs: Any,
) -> Awaitable[Any]:
    """``distributed.core.send_recv``, in an ``rpc <op>`` span when the request is traced.

    Not a coroutine itself: the caller awaits Dask's own (or :func:`_recorded`), so an
    exception it raises carries no frame of this function.
    """
    state = rpc_patch.recording
    request = None
    if state is not None:
        try:
            request = _request(state, kwargs.get("op"), comm)
        except Exception:
            request = None  # telemetry never stands between Dask and its peers
    call = functools.partial(
        _original_send_recv,
        comm,
        reply=reply,
        serializers=serializers,
        deserializers=deserializers,
        **kwargs,
    )
    if request is None:
        return call()
    parent, attributes = request
    spans = state.spans  # type: ignore[union-attr]
    return _recorded(call, spans, f"rpc {kwargs['op']}", parent, SpanKind.CLIENT, attributes)


async def _recorded(
    call: Any,
    spans: EndedSpans,
    name: str,
    parent: trace.Span,
    kind: SpanKind,
    attributes: dict[str, Any],
) -> Any:
    """Await ``call``; then the span ``name`` is built from its times (ERROR if it raised)
    under ``parent``, or beside it, linked, if ``parent`` ended first (a P2P shuffle's
    sends outlast the task that queued them). What it raises leaves without this frame
    in its traceback."""
    start = time_ns()
    error = None
    try:
        result = call()
        return await result if inspect.isawaitable(result) else result
    except BaseException as e:
        errors.hide_frame(e)
        error = e
        raise
    finally:
        end = time_ns()
        context = parent.get_span_context()
        moved = parent.outlived_by(end) if isinstance(parent, DeferredSpan) else None
        if moved is None:
            spans.submit(name, context, kind, (start, end), attributes, error)
        else:
            link = trace.Link(context, {"dask.link": "started-in"})
            spans.submit(name, moved, kind, (start, end), attributes, error, [link])
        error = None  # no cycle exception -> traceback -> frame -> error (3.10 keeps it)


def traced_handler(handler: Callable[..., Any], op: str, spans: EndedSpans) -> Callable[..., Any]:
    """``handler`` in a SERVER span ``rpc <op>``; its signature stays (Dask inspects it)."""

    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Returns the coroutine Dask awaits: no frame of its own in a failure's traceback.
        call = functools.partial(handler, *args, **kwargs)
        comm = args[0] if args else kwargs.get("comm")
        try:
            attributes = {
                **identity.hosted.attributes,
                "rpc.system.name": SYSTEM,
                "rpc.method": op,
                **peer_attributes(getattr(comm, "peer_address", None), "network.peer"),
            }
        except Exception:  # telemetry never stands between Dask and its peers
            return call()
        # A root: nothing links a request to its sender's trace.
        root = trace.INVALID_SPAN
        return _recorded(call, spans, f"rpc {op}", root, SpanKind.SERVER, attributes)

    return wrapper


def trace_handlers(server: Any, tracer: trace.Tracer, settings: Settings) -> dict[str, Any]:
    """Wrap the server's handlers of ``otel.rpc.always-record``; returns the originals."""
    originals: dict[str, Any] = {}
    if not settings.rpc_spans:
        return originals
    spans = ended_spans(tracer, settings.max_attribute_length)
    for op in settings.rpc_always_record - settings.rpc_never_record:
        handler = server.handlers.get(op)
        if handler is not None:
            originals[op] = handler
            server.handlers[op] = traced_handler(handler, op, spans)
    return originals


def _bindings() -> list[ModuleType]:
    """Every ``distributed`` module holding Dask's ``send_recv``, by name."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("distributed")
        and getattr(module, "send_recv", None) is _original_send_recv
    ]


def install(tracer: trace.Tracer, settings: Settings) -> None:
    """Record ``rpc`` spans in this process from now on (again: new tracer, settings).

    The modules are searched once; later calls (a client activates on every submission)
    only swap the state.
    """
    rpc_patch.recording = _Recording(tracer, settings)
    if not rpc_patch.patched:
        rpc_patch.patched.extend(_bindings())
        for module in rpc_patch.patched:
            module.send_recv = send_recv


def uninstall() -> None:
    """Record no more ``rpc`` spans; those recorded are built first (boundedly)."""
    rpc_patch.recording = None
    emitter.shared().flush(emitter.EXIT_TIMEOUT)
    for module in rpc_patch.patched:
        module.send_recv = _original_send_recv
    rpc_patch.patched.clear()
