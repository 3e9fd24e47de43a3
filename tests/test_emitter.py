"""The scheduler's span emitter: order, flushing, failures, and no thread left behind."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time

from dask_otel.spans import emitter as emitter_module
from dask_otel.spans.emitter import SpanEmitter


def emitter_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_calls_run_in_order_and_a_failure_stops_nothing():
    emitter = SpanEmitter("test-emitter")
    seen: list[int] = []
    emitter.submit(seen.append, 1)
    emitter.submit(lambda: 1 / 0)
    emitter.submit(seen.append, 2)
    assert emitter.flush(5)
    assert seen == [1, 2]
    assert len(emitter_threads("test-emitter")) == 1


def test_the_thread_ends_when_idle_and_comes_back_on_demand():
    emitter = SpanEmitter("test-emitter-idle", interval=0.01, idle=0.05)
    assert not emitter_threads("test-emitter-idle")  # nothing submitted, no thread
    seen: list[int] = []
    emitter.submit(seen.append, 1)
    deadline = time.monotonic() + 5
    while emitter_threads("test-emitter-idle") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1] and not emitter_threads("test-emitter-idle")
    emitter.submit(seen.append, 2)
    assert emitter.flush(5)
    assert seen == [1, 2]


def test_close_emits_everything_and_ends_the_thread_at_once():
    """What a closing scheduler or worker does: no thread left to wait for (the idle
    timeout is an hour here); the next submission starts one again."""
    emitter = SpanEmitter("test-emitter-close", idle=3600)
    seen: list[int] = []
    emitter.submit(seen.append, 1)
    assert emitter.close(5)
    assert seen == [1] and not emitter_threads("test-emitter-close")
    emitter.submit(seen.append, 2)
    assert emitter.flush(5)
    assert seen == [1, 2]
    time.sleep(0.3)  # several wake-ups: the new thread is not closing
    assert len(emitter_threads("test-emitter-close")) == 1
    assert emitter.close(5)


def test_submissions_racing_the_thread_ending_are_never_lost():
    emitter = SpanEmitter("test-emitter", interval=0.001, idle=0.001)
    seen: list[int] = []
    for i in range(2000):
        emitter.submit(seen.append, i)
        if i % 50 == 0:
            time.sleep(0.002)  # let the thread go idle and retire now and then
    assert emitter.flush(10)
    assert seen == list(range(2000))


def test_no_thread_to_start_fails_no_caller_and_the_next_submit_tries_again(monkeypatch, caplog):
    start = threading.Thread.start

    def out_of_threads(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    emitter = SpanEmitter("test-emitter-no-thread")
    seen: list[int] = []
    monkeypatch.setattr(threading.Thread, "start", out_of_threads)
    emitter.submit(seen.append, 1)  # a task's finally, a transfer's end: must not raise
    assert not emitter_threads("test-emitter-no-thread")
    assert "no thread for spans" in caplog.text
    monkeypatch.setattr(threading.Thread, "start", start)
    emitter.submit(seen.append, 2)
    assert emitter.flush(5)
    assert seen == [1, 2]  # the backlog was kept


def test_the_thread_pauses_between_slices_of_work_unless_far_behind(monkeypatch):
    """Working through a backlog, the thread sleeps ``PAUSE`` after every ``SLICE``
    seconds of work (the event loop's chance to take the GIL), but not while more than
    ``PAUSE_BELOW`` records wait (a busy loop would leave it one slice per switch
    interval). A pause made long here (30 ms) cannot be mistaken for a preemption."""
    monkeypatch.setattr(emitter_module, "SLICE", 0.0002)
    monkeypatch.setattr(emitter_module, "PAUSE", 0.03)
    monkeypatch.setattr(emitter_module, "PAUSE_BELOW", 200)
    emitter = SpanEmitter("test-slices")
    times: list[tuple[float, float]] = []

    def busy() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 5e-5:
            pass
        times.append((start, time.perf_counter()))

    for _ in range(240):  # one backlog: far behind at first, the last 2 ms of work not
        emitter.submit(busy)
    assert emitter.flush(10)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(times)]
    # After call i, 240 - i records wait (the flush's own too): pauses from call 41 on.
    assert max(gaps[:40]) < 0.03
    assert sum(gap >= 0.03 for gap in gaps[40:]) >= 3  # 2 ms in 0.2 ms slices: ~10


def test_a_forked_child_starts_its_own_thread_and_leaves_the_parents_backlog():
    """A Nanny's worker started with the ``fork`` method, from a process whose emitter is
    busy: the child must emit with a thread of its own (the parent's did not come along),
    and not emit what the parent had queued (the parent does)."""
    emitter = SpanEmitter("test-emitter-fork")
    busy, release = threading.Event(), threading.Event()
    seen: list[str] = []
    emitter.submit(lambda: (busy.set(), release.wait(10)))
    assert busy.wait(5)  # the thread is working ...
    emitter.submit(seen.append, "parent")  # ... and this waits for it
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            emitter.submit(seen.append, "child")
            code = 0 if emitter.flush(5) and seen == ["child"] else 1
        finally:
            os._exit(code)
    release.set()
    assert os.waitpid(pid, 0)[1] == 0
    assert emitter.flush(5)
    assert seen == ["parent"]


def test_the_exit_waits_for_the_call_in_progress(tmp_path):
    """A Nanny's post-mortem of a worker that died as the Nanny closed is running when the
    interpreter exits, with nothing left queued: the exit still waits for it."""
    done = tmp_path / "done"
    script = f"""
import threading, time
from pathlib import Path
from dask_otel.spans.emitter import SpanEmitter

started = threading.Event()

def post_mortem():
    started.set()
    time.sleep(0.5)
    Path({str(done)!r}).touch()

emitter = SpanEmitter("exiting")
emitter.submit(post_mortem)
assert started.wait(5)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    assert done.exists()
