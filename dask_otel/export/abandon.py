"""Exports that a closed cluster does not wait for.

The OTLP/gRPC exporters retry a failed export until their timeout (10 s by default),
sleeping between attempts, and wait as long for a hung collector's answer. While Dask runs
that costs nothing but a background thread's time. Once every Dask server and traced
client of the process has closed, it keeps a thread of dask-otel's running for seconds
after the cluster is gone (distributed's tests fail a test that leaves one), and keeps
waiting whatever waits for that export. So an export is given up, its batch counted as
lost, as soon as nothing of Dask's runs in the process (any more, or at all: a process
that only logs through Dask's loggers) and the collector is down
or hung as far as the exports tell (``runtime.health``): the exporter's sleep between
attempts looks every :data:`LOOK` seconds, and while an OTLP/gRPC call waits for its
answer a thread of its own looks as often, to cancel it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from dask_otel import runtime
from dask_otel.runtime_state import ProcessState

#: Seconds between two looks, in an export, at whether to give it up.
LOOK = 0.05


def abandoned() -> bool:
    """Whether exports under way are given up: the collector does not answer, and no
    Dask server or traced client of this process runs (they have all closed, or none
    ever ran)."""
    return runtime.health.failing() and runtime.metric_demand.unheld()


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
        with waiting.listed(self._exporter):
            return self._stub.Export(request=request, metadata=metadata, timeout=timeout)


class WaitingCalls(ProcessState):
    """The OTLP/gRPC calls waiting for an answer, and the thread that cancels them if the
    collector does not answer once nothing of Dask's runs in the process (it runs only
    while calls wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The exporter of each call waiting for an answer.
        self._calls: dict[object, Any] = {}
        #: The thread cancelling them, while any waits.
        self._canceller: threading.Thread | None = None

    @contextlib.contextmanager
    def listed(self, exporter: Any) -> Iterator[None]:
        """A call of ``exporter`` waits for its answer while this lasts."""
        call = object()
        with self._lock:
            self._calls[call] = exporter
        try:
            self._watch()
            yield
        finally:
            with self._lock:
                del self._calls[call]

    def _watch(self) -> None:
        with self._lock:
            if not self._calls or self._canceller is not None:
                return
            canceller = threading.Thread(target=self._cancel, name="dask-otel-abandon", daemon=True)
            try:
                canceller.start()
            except RuntimeError:  # an interpreter's exit that refuses threads: bounded by its own
                return
            self._canceller = canceller

    def _cancel(self) -> None:
        cut: set[object] = set()  # calls cancelled, while their threads list them still
        while True:
            time.sleep(LOOK)
            with self._lock:
                calls = dict(self._calls)
                if not calls:
                    self._canceller = None  # a call listed from now on starts another
                    return
            if abandoned():
                for exporter in {calls[call] for call in calls.keys() - cut}:
                    _cut(exporter)
                cut = set(calls)

    def forget_parent(self) -> None:
        """The parent's calls and canceller are not here."""
        self._lock = threading.Lock()
        self._calls = {}
        self._canceller = None


#: The one per process.
waiting = runtime.own(WaitingCalls())


def _cut(exporter: Any) -> None:
    """Cancel the calls of ``exporter`` by closing their channel (the exporter then sleeps
    before retrying, and :class:`_Backoff` ends the export); its next one has a new
    channel."""
    with runtime.fork_gate.work():
        channel = exporter._channel
        exporter._initialize_channel_and_stub()
        channel.close()


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
