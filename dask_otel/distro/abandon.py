"""Exports that a closed cluster does not wait for.

The OTLP/gRPC exporters retry a failed export until their timeout (10 s by default),
sleeping between attempts, and wait as long for a hung collector's answer. While Dask runs
that costs nothing but a background thread's time. Once every Dask server and traced
client of the process has closed, it keeps a thread of dask-otel's running for seconds
after the cluster is gone (distributed's tests fail a test that leaves one), and keeps
waiting whatever waits for that export. So an export is given up, its batch counted as
lost, as soon as nothing of Dask's runs in the process any more and the collector is down
or hung as far as the exports tell (``runtime.health``): the exporter's sleep between
attempts and its wait for an answer look every :data:`LOOK` seconds.
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
    """The exporter's ``_shutdown_in_progress``, on which it sleeps between attempts: the
    sleep also ends when the export is given up (the exporter then stops retrying)."""

    def wait(self, timeout: float | None = None) -> bool:
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while not super().wait(min(LOOK, max(0.0, deadline - time.monotonic()))):
            if abandoned():
                return True
            if time.monotonic() >= deadline:
                return False
        return True


class _Stub:
    """The exporter's gRPC stub: an export waits for its answer in slices, and is cancelled
    when given up."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def Export(self, request: Any, metadata: Any = None, timeout: float | None = None) -> Any:
        call = self._stub.Export.future(request, metadata=metadata, timeout=timeout)
        answered = threading.Event()
        call.add_done_callback(lambda _: answered.set())
        while not answered.wait(LOOK):
            if abandoned() and call.cancel():
                raise call  # an RpcError (CANCELLED), which the exporter does not retry
        return call.result()  # raises the call's RpcError, which the exporter handles


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
        exporter._stub = lambda channel: _Stub(stub(channel))
        if client is not None:
            exporter._client = _Stub(client)
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
