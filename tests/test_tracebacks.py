"""The tracebacks users get are the ones plain Dask gives: dask-otel adds no frame.

Each scenario fails once without dask-otel and once with it, in this process; the frames
of the exception that reaches the user (file, function, source line) must be the same.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import in_process_cluster, instrumented
from distributed import Worker
from opentelemetry import trace

import dask_otel

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Python 3.10 re-adds a re-raising frame to the traceback (docs/design-notes.md)",
)


def divide_by_zero(*args: object) -> float:
    """At module level: pickled by reference, so its frames name this file and line (a
    function pickled by value shows ``<dynamic-code>``, without source)."""
    return 1 / 0


def frames(tb) -> list[tuple[str, str, str | None]]:
    return [(Path(f.filename).name, f.name, f.line) for f in traceback.extract_tb(tb)]


def raised(scenario: Callable[[], object]) -> list[tuple[str, str, str | None]]:
    """The frames of what ``scenario`` raises, as the user catches it."""
    try:
        scenario()
    except Exception as e:
        return frames(e.__traceback__)
    raise AssertionError(f"{scenario} did not fail")


def same_plain_and_instrumented(scenario: Callable[[], object]) -> list:
    plain = raised(scenario)
    with instrumented():
        traced = raised(scenario)
    assert traced == plain
    return plain


def test_a_failing_task(tmp_path):
    """The traceback the client gets for a task (``Future.traceback``), and the one of
    the exception ``result()`` raises."""

    def scenario() -> None:
        with in_process_cluster(n_workers=1) as client:
            future = client.submit(divide_by_zero, 1)
            with pytest.raises(ZeroDivisionError):
                future.result()
            shown.append(frames(future.traceback()))
            future.result()

    shown: list = []
    result_frames = same_plain_and_instrumented(scenario)
    plain, traced = shown
    assert traced == plain
    assert ("test_tracebacks.py", "divide_by_zero", "return 1 / 0") in plain
    assert result_frames[-1] == ("test_tracebacks.py", "divide_by_zero", "return 1 / 0")


def test_a_submission_that_fails_in_the_client():
    with in_process_cluster(n_workers=1) as client:
        shown = same_plain_and_instrumented(lambda: client.submit(divide_by_zero, 1, key=b"k"))
    assert not [f for f in shown if "dask_otel" in f[0] or f[1] == "traced_graph_to_futures"]


def test_a_failing_request_to_the_scheduler():
    """A request whose handler fails on the scheduler (Dask raises the scheduler's
    exception in the requester), traced (a user span is current) or not."""

    def scenario(in_span: bool) -> None:
        with in_process_cluster(n_workers=1) as client:
            client.submit(divide_by_zero, 1)  # the client activates dask-otel
            tracer = dask_otel.runtime.current().tracer()
            span = tracer.start_span("user") if in_span else trace.INVALID_SPAN
            with trace.use_span(span, end_on_exit=True):
                client.sync(client.scheduler.ncores, workers=5)  # ints are not iterable

    same_plain_and_instrumented(lambda: scenario(False))
    same_plain_and_instrumented(lambda: scenario(True))


def test_a_server_that_cannot_be_made():
    same_plain_and_instrumented(lambda: Worker("tcp://127.0.0.1:1", no_such_argument=1))
