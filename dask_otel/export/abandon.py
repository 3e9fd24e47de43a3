"""Exports that a closed cluster does not wait for.

The OTLP/gRPC exporters retry a failed export until their timeout (10 s by default),
sleeping between attempts, and wait as long for a hung collector's answer. While Dask runs
that costs nothing but a background thread's time. Once every Dask server and traced
client of the process has closed, it keeps a thread of dask-otel's running for seconds
after the cluster is gone (distributed's tests fail a test that leaves one), and keeps
waiting whatever waits for that export. So an export is given up, its batch counted as
lost, as soon as nothing of Dask's runs in the process any more and the collector is down
or hung as far as the exports tell (``runtime.health``): the exporter's sleep between
attempts looks every :data:`LOOK` seconds, and while an OTLP/gRPC call waits for its
answer a thread of its own looks as often, to cancel it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from dask_otel import runtime

#: Seconds between two looks, in an export, at whether to give it up.
LOOK = 0.05


def abandoned() -> bool:
    """Whether exports under way are given up: the collector does not answer, and the
    Dask servers and traced clients of this process have all closed."""
    return runtime.health.failing() and runtime.metric_demand.released()


class _Backoff(threading.Event):
    """The event an exporter sleeps on between attempts (the OTLP/gRPC exporters'
    ``_shutdown_in_progress``, the OTLP/HTTP client's ``_shutdown_event``): the
    sleep also ends when the export is given up (the exporter then stops retrying). That
    it sleeps tells that the collector failed an attempt (``runtime.health`` hears of it)."""

    def wait(self, timeout: float | None = None) -> bool:
        runtime.health.attempt_failed()
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while not super().wait(min(LOOK, max(0.0, deadline - time.monotonic()))):
            if abandoned():
                return True
            if time.monotonic() >= deadline:
                return False
        return True


class _Stub:
    """The exporter's gRPC stub: its calls are listed while they wait for an answer, for
    :func:`_cut` to cancel them (blocking calls, as the exporter makes them: a call's
    future would need gRPC's own thread, which a fork can split)."""

    def __init__(self, stub: Any, exporter: Any) -> None:
        self._stub = stub
        self._exporter = exporter

    def Export(self, request: Any, metadata: Any = None, timeout: float | None = None) -> Any:
        call = object()
        with _lock:
            _calls[call] = self._exporter
        try:
            _watch()
            return self._stub.Export(request=request, metadata=metadata, timeout=timeout)
        finally:
            with _lock:
                del _calls[call]


#: The exporter of each call waiting for an answer; the thread cancelling them.
_calls: dict[object, Any] = {}
_lock = threading.Lock()
_canceller: threading.Thread | None = None


def _watch() -> None:
    """While calls wait for an answer, a thread that cancels them if the collector does
    not answer once nothing of Dask's runs in the process; it ends when none waits."""
    global _canceller
    with _lock:
        if not _calls or _canceller is not None:
            return
        canceller = threading.Thread(target=_cancel, name="dask-otel-abandon", daemon=True)
        try:
            canceller.start()
        except RuntimeError:  # an interpreter's exit that refuses threads: bounded by its own
            return
        _canceller = canceller


def _cancel() -> None:
    global _canceller
    cut: set[object] = set()  # calls cancelled, while their threads list them still
    while True:
        time.sleep(LOOK)
        with _lock:
            waiting = dict(_calls)
            if not waiting:
                _canceller = None  # a call listed from now on starts another
                return
        if runtime.health.failing() and runtime.metric_demand.released():
            for exporter in {waiting[call] for call in waiting.keys() - cut}:
                _cut(exporter)
            cut = set(waiting)


def _cut(exporter: Any) -> None:
    """Cancel the calls of ``exporter`` by closing their channel (the exporter then sleeps
    before retrying, and :class:`_Backoff` ends the export); its next one has a new
    channel."""
    with runtime.fork_gate.work():
        channel = exporter._channel
        exporter._initialize_channel_and_stub()
        channel.close()


def _forget_parent() -> None:
    """In a forked child: the parent's calls and canceller are not here."""
    global _lock, _canceller
    _lock = threading.Lock()
    _calls.clear()
    _canceller = None


runtime.forget_in_child(_forget_parent)


def abandonable(exporter: Any) -> None:
    """Make the waits of ``exporter``'s exports end when they are given up: the OTLP/gRPC
    exporters' sleeps and calls, the OTLP/HTTP exporters' sleeps (a request they sent
    runs to its timeout). Other exporters are left as they are."""
    grpc_module = sys.modules.get("opentelemetry.exporter.otlp.proto.grpc.exporter")
    http_module = sys.modules.get("opentelemetry.exporter.otlp.common.http")
    client = getattr(exporter, "_client", None)
    if isinstance(exporter, getattr(grpc_module, "OTLPExporterMixin", ())):
        if isinstance(client, _Stub):
            return
        exporter._shutdown_in_progress = _backoff(exporter._shutdown_in_progress)
        stub = exporter._stub  # a new channel (after UNAVAILABLE) makes a new stub with it
        exporter._stub = lambda channel: _Stub(stub(channel), exporter)
        if client is not None:
            exporter._client = _Stub(client, exporter)
    elif isinstance(client, getattr(http_module, "_OTLPHTTPClient", ())):
        client._shutdown_event = _backoff(client._shutdown_event)


def _backoff(event: threading.Event) -> _Backoff:
    """A :class:`_Backoff` in place of ``event``, set if it is."""
    if isinstance(event, _Backoff):
        return event
    backoff = _Backoff()
    if event.is_set():
        backoff.set()
    return backoff
