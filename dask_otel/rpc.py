"""``rpc <op>`` spans: Dask's request/response messages between processes.

Every outgoing request goes through ``distributed.core.send_recv``, which several modules
import by name: each binding is replaced (:func:`install`). A CLIENT span is recorded when
a traced operation is current (a ``transfer``'s ``get_data`` request, a user's span around
``client.gather``) or the op is listed in ``otel.rpc.always-record``; everything else,
heartbeats above all, costs one check. Handled requests (SERVER spans) are recorded for the
always-recorded ops: no trace context travels in Dask's messages, so a server cannot tell
a traced request from any other (``get_data`` has its own span, see ``worker.py``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any

from distributed import core
from distributed.comm.addressing import get_address_host_port
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from dask_otel import errors, logs

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from dask_otel.config import Settings

#: ``rpc.system.name`` of every span: Dask's own protocol.
SYSTEM = "dask"

_original_send_recv = core.send_recv


class _State:
    """What the patched ``send_recv`` needs; replaced whole so readers see one snapshot."""

    def __init__(self, tracer: trace.Tracer, settings: Settings) -> None:
        self.tracer = tracer
        self.always = settings.rpc_always_record
        self.never = settings.rpc_never_record
        self.limit = settings.max_attribute_length


_state: _State | None = None


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


def _start(state: _State, op: Any, comm: Any) -> trace.Span | None:
    """The CLIENT span of a request, or None if it is not recorded."""
    if op in state.never or not isinstance(op, str):
        return None
    if op not in state.always and not trace.get_current_span().is_recording():
        return None
    peer = getattr(comm, "peer_address", None)
    return state.tracer.start_span(
        f"rpc {op}",
        kind=SpanKind.CLIENT,
        attributes={
            **logs.identity,
            "rpc.system.name": SYSTEM,
            "rpc.method": op,
            **peer_attributes(peer, "server"),
            **peer_attributes(peer, "network.peer"),
        },
    )


async def send_recv(
    comm: Any,
    *,
    reply: bool = True,
    serializers: Any = None,
    deserializers: Any = None,
    **kwargs: Any,
) -> Any:
    """``distributed.core.send_recv``, in an ``rpc <op>`` span when the request is traced."""
    state = _state
    span = None
    if state is not None:
        try:
            span = _start(state, kwargs.get("op"), comm)
        except Exception:
            span = None  # telemetry never stands between Dask and its peers
    if span is None:
        return await _original_send_recv(
            comm, reply=reply, serializers=serializers, deserializers=deserializers, **kwargs
        )
    call = functools.partial(
        _original_send_recv,
        comm,
        reply=reply,
        serializers=serializers,
        deserializers=deserializers,
        **kwargs,
    )
    return await _traced(span, call, state.limit)  # type: ignore[union-attr]


async def _traced(span: trace.Span, call: Any, limit: int) -> Any:
    """Await ``call`` and end ``span``; a failure makes it an ERROR. Nothing nests under a
    request, so the span is not made current (that would cost a context copy each)."""
    try:
        result = call()
        return await result if inspect.isawaitable(result) else result
    except BaseException as e:
        errors.record_exception(span, e, None, None, limit)
        raise
    finally:
        span.end()


def traced_handler(
    handler: Callable[..., Any], op: str, tracer: trace.Tracer, limit: int
) -> Callable[..., Any]:
    """``handler`` in a SERVER span ``rpc <op>``; its signature stays (Dask inspects it)."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = functools.partial(handler, *args, **kwargs)
        comm = args[0] if args else kwargs.get("comm")
        try:
            span = tracer.start_span(
                f"rpc {op}",
                context=Context(),  # nothing links a request to its sender's trace
                kind=SpanKind.SERVER,
                attributes={
                    **logs.identity,
                    "rpc.system.name": SYSTEM,
                    "rpc.method": op,
                    **peer_attributes(getattr(comm, "peer_address", None), "network.peer"),
                },
            )
        except Exception:  # telemetry never stands between Dask and its peers
            result = call()
            return await result if inspect.isawaitable(result) else result
        return await _traced(span, call, limit)

    return wrapper


def trace_handlers(server: Any, tracer: trace.Tracer, settings: Settings) -> dict[str, Any]:
    """Wrap the server's handlers of ``otel.rpc.always-record``; returns the originals."""
    originals: dict[str, Any] = {}
    if not settings.rpc_spans:
        return originals
    for op in settings.rpc_always_record - settings.rpc_never_record:
        handler = server.handlers.get(op)
        if handler is not None:
            originals[op] = handler
            server.handlers[op] = traced_handler(handler, op, tracer, settings.max_attribute_length)
    return originals


#: The ``distributed`` modules whose ``send_recv`` binding :func:`install` replaced.
_patched: list[ModuleType] = []


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
    global _state
    _state = _State(tracer, settings)
    if not _patched:
        _patched.extend(_bindings())
        for module in _patched:
            module.send_recv = send_recv


def uninstall() -> None:
    global _state
    _state = None
    for module in _patched:
        module.send_recv = _original_send_recv
    _patched.clear()
