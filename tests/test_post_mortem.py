"""The KilledWorker post-mortem, end to end: the telemetry alone says which task, which
workers, when, why each died, what it ran, its memory before and its last log lines.

Real processes under ``opentelemetry-instrument``: a scheduler and two ``dask worker``
processes (each a Nanny and its worker) at ``--memory-limit 400MB``, exporting over OTLP
to a receiver on 127.0.0.1, and to OTLP JSON files for ``dask-otel summarize``.
tests/scripts/post_mortem.py runs a task that allocates until the Nanny kills its
worker, twice (KilledWorker), then SIGKILLs a worker process in the middle of a task.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import os
import signal
import tempfile
import time
from pathlib import Path

import dask
import pytest
from conftest import (
    Telemetry,
    flush_emitters,
    in_process_cluster,
    otel_env,
    run_client,
    start_scheduler,
    start_worker,
)
from distributed.diagnostics.plugin import NannyPlugin
from distributed.scheduler import KilledWorker
from opentelemetry.trace import StatusCode
from span_checks import assert_no_orphans
from test_flight import run_child

import dask_otel
from dask_otel.postmortem import folders, labels
from dask_otel.spans import emitter
from dask_otel.tools.report import render
from dask_otel.tools.summary import summarize

MEMORY_LIMIT = 400_000_000
#: Quick tasks each worker runs before a death: their spans wait in its export queue.
TICKS = 30


def died(rx, cause):
    return [
        r
        for r in rx.log_records()
        if r["event_name"] == "dask.worker.died"
        and r["attributes"]["dask.worker.death.cause"] == cause
    ]


@pytest.mark.timeout(300)
def test_killed_worker_post_mortem(receiver, processes):
    files = processes.tmp_path / "otlp"
    exporters = {f"OTEL_{s}_EXPORTER": "otlp,otlp_json_file" for s in ("TRACES", "LOGS")}
    env = otel_env(
        receiver,
        DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="1",
        DASK_OTEL_FILE_EXPORT_DIR=str(files),
        **exporters,
    )
    # Nannies and their workers hold spans and log records for a minute: what a worker
    # queued before it died arrives only if its Nanny sends it.
    held = {**env, "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BLRP_SCHEDULE_DELAY": "60000"}
    address = start_scheduler(processes, env)
    nannies = [
        start_worker(processes, held, address, f"w{i}", options=("--memory-limit", "400MB"))
        for i in range(2)
    ]
    observed, _ = run_client(processes, env, address, script="post_mortem.py")
    for nanny in nannies:  # a graceful stop: each Nanny sends what it holds
        assert processes.stop(nanny) == 0

    (task,) = receiver.wait_for(lambda r: r.spans(name="task hog"))
    assert "KilledWorker" in task["status_message"] or task["status_code"] == 2
    killed_on = next(e for e in task["events"] if e["name"] == "exception")["attributes"][
        "dask.task.workers"
    ]
    assert sorted(killed_on) == observed["hog_workers"]
    cluster = task["attributes"]["dask.cluster.id"]

    # Why each worker died: its Nanny's memory monitor, with the reading and the limit.
    memory = receiver.wait_for(lambda r: len(died(r, "memory")) == 2 and died(r, "memory"))
    assert sorted(r["attributes"]["dask.worker.address"] for r in memory) == sorted(killed_on)
    for record in memory:
        a = record["attributes"]
        assert record["resource"]["service.name"] == "dask-nanny"
        assert a["dask.cluster.id"] == cluster
        assert a["dask.nanny.address"].startswith("tcp://127.0.0.1:")
        assert a["dask.worker.death.signal"] == "SIGTERM"
        assert a["dask.worker.memory.limit"] == MEMORY_LIMIT
        assert a["dask.worker.memory.rss_at_kill"] > 0.95 * MEMORY_LIMIT
        assert task["start_ns"] < record["time_ns"] <= task["end_ns"] + 5e9
        # What it was running, in which computation.
        assert a["dask.task.keys"] == ["hog-0"]
        assert a["dask.trace_ids"] == [task["trace_id"]]
        # Its memory in the seconds before: the climb, one reading per monitor interval.
        history, times = a["dask.worker.memory.history"], a["dask.worker.memory.history_times"]
        assert len(history) == len(times) >= 10
        assert max(history) > 0.9 * MEMORY_LIMIT and min(history) < 0.5 * MEMORY_LIMIT
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(gap > 0 for gap in gaps) and sorted(gaps)[len(gaps) // 2] < 0.5e9
        # Its last log lines: the task's own, and the worker pausing on memory.
        lines = "\n".join(a["dask.worker.last_logs"])
        assert "hog: allocating" in lines and "Pausing worker" in lines
        assert "died: terminated by its Nanny" in record["body"]

    # A worker process killed with SIGKILL in the middle of a task.
    (sigkill,) = receiver.wait_for(lambda r: died(r, "signal"))
    a = sigkill["attributes"]
    assert a["dask.worker.death.signal"] == "SIGKILL"
    assert a["process.pid"] == observed["sigkill_pid"]
    assert a["dask.worker.address"] == observed["sigkill_worker"]
    assert a["dask.task.keys"] == ["sleeper-0"]
    assert "sleeper: started" in "\n".join(a["dask.worker.last_logs"])
    (sleeper_task,) = receiver.spans(name="task sleeper")
    assert a["dask.trace_ids"] == [sleeper_task["trace_id"]]

    # Each lost attempt: a `died <prefix>` span in the task's trace, and a record in it.
    lost = [s for s in receiver.spans() if s["name"] in ("died hog", "died sleeper")]
    assert sorted(s["attributes"]["dask.task.key"] for s in lost) == [
        "hog-0",
        "hog-0",
        "sleeper-0",
    ]
    spans = {(s["trace_id"], s["span_id"]): s for s in receiver.spans()}
    for span in lost:
        assert span["status_code"] == 2 and span["resource"]["service.name"] == "dask-nanny"
        # Beside the span the scheduler emits for the attempt lost with the worker, under
        # the graph, and linked to it.
        assert spans[span["trace_id"], span["parent_span_id"]]["name"] == "graph"
        (link,) = span["links"]
        lost_attempt = spans[link["trace_id"], link["span_id"]]
        assert lost_attempt["name"] == f"attempt {span['attributes']['dask.task.prefix']}"
        assert (
            lost_attempt["attributes"]["dask.worker.address"]
            == span["attributes"]["dask.worker.address"]
        )
        if lost_attempt["name"] == "attempt hog":  # the scheduler heard of the kill first
            assert "memory limit" in lost_attempt["status_message"]
            attributes = lost_attempt["attributes"]
            assert attributes["dask.worker.death.cause"] == "memory"
            assert attributes["dask.worker.memory.limit"] == MEMORY_LIMIT
            assert attributes["dask.worker.memory.rss_at_kill"] > 0.95 * MEMORY_LIMIT
    records = [r for r in receiver.log_records() if r["event_name"] == "dask.task.lost"]
    assert {(r["trace_id"], r["span_id"]) for r in records} == {
        (s["trace_id"], s["span_id"]) for s in lost
    }

    # Nothing the dead workers recorded is lost: their queued spans and log records
    # (held a minute) were sent by their Nannies, under the workers' own resources.
    # A worker killed within moments of finishing tasks may not have built their spans
    # yet: its recorder names them, so that none is lost silently.
    unreported = [k for k in a.get("dask.task.unreported", ()) if k.startswith("tick-")]
    print(f"SIGKILL: {len(unreported)} tick attempts finished but not reported")
    ticks = receiver.wait_for(
        lambda r: (
            len(r.spans(name="task tick")) + len(unreported) == 3 * TICKS
            and r.spans(name="task tick")
        )
    )
    assert {s["resource"]["service.name"] for s in ticks} == {"dask-worker"}
    for record in [*memory, sigkill]:
        recovered = record["attributes"]["dask_otel.recovered.spans"]
        assert recovered + len(record["attributes"].get("dask.task.unreported", ())) >= TICKS
    # The tasks' own log records: each hog attempt's, and both sleeper attempts'.
    user = [r for r in receiver.log_records() if str(r["body"]).startswith(("hog:", "sleeper:"))]
    assert len(user) == 4 and {r["resource"]["service.name"] for r in user} == {"dask-worker"}

    # The Nanny's own records: the memory kill and the signal, naming the worker.
    nanny_records = [r for r in receiver.log_records() if r["scope"] == "distributed.nanny.memory"]
    assert any("exceeded 95% memory budget" in str(r["body"]) for r in nanny_records)
    signalled = [r for r in receiver.log_records() if "was killed by signal 9" in str(r["body"])]
    assert signalled[0]["attributes"]["dask.worker.address"] == observed["sigkill_worker"]

    # The worker's memory as a metric: one histogram point per export, its max the peak.
    points = receiver.wait_for(lambda r: r.metrics("dask.nanny.worker.memory"))
    assert max(p["value"]["max"] for p in points) > 0.9 * MEMORY_LIMIT

    # dask-otel summarize, from the OTLP JSON files alone.
    text = io.StringIO()
    render(summarize(files), text)
    section = text.getvalue().split("Workers that died (3):\n", 1)[1]
    for address in killed_on:
        assert address in section
    assert section.count("memory: terminated by its Nanny") == 2
    assert "SIGKILL" in section and "sleeper-0" in section and "hog-0" in section
    assert task["trace_id"] in section and "hog: allocating" in section


def exit_3(x: int) -> int:
    os._exit(3)


def segfault(x: int) -> int:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return x


@pytest.mark.parametrize("ratio", [1.0, 0.0])
@pytest.mark.parametrize(
    ("task", "cause", "how"),
    [
        (exit_3, "exit", ("process.exit.code", 3)),
        (segfault, "crash", ("dask.worker.death.signal", "SIGSEGV")),
    ],
)
def test_nanny_in_this_process_explains_each_death(telemetry, monkeypatch, task, cause, how, ratio):
    """A ``LocalCluster``'s Nannies run in the client's process, with its providers. A
    thinned task (``ratio`` 0) lost with its workers is traced all the same."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    with (
        dask.config.set(
            {"distributed.scheduler.allowed-failures": 1, "otel.task.sample-ratio": ratio}
        ),
        in_process_cluster(processes=True, host="127.0.0.1") as client,
    ):
        key = f"{task.__name__}-1"
        with pytest.raises(KilledWorker):
            client.submit(task, 1, key=key).result(timeout=120)
        # Both Nannies restarted their workers: closed while one starts, distributed
        # 2025.9 counts the start against the close's deadline (TimeoutError under load).
        client.wait_for_workers(2, timeout=120)
        flush_emitters(client)
    # The Nannies (in this process) have seen every exit once the cluster closed.
    assert emitter.shared().flush(10)

    deaths = [r for r in telemetry.logs() if r.event_name == "dask.worker.died"]
    assert len(deaths) == 2
    for death in deaths:
        attributes = death.attributes
        assert attributes["dask.worker.death.cause"] == cause
        assert attributes[how[0]] == how[1]
        assert attributes["dask.task.keys"] == (key,)
    (span,) = telemetry.spans(f"task {task.__name__}")
    # Each `died` span beside the lost attempt's span, which the scheduler emits (same id:
    # computed from the annotation the attempt ran with) and it links; all under the graph.
    attempts = telemetry.spans(f"attempt {task.__name__}")
    died = telemetry.spans(f"died {task.__name__}")
    assert len(died) == 2 and len(attempts) == 2
    linked = {link.context.span_id for s in died for link in s.links}
    assert linked == {a.context.span_id for a in attempts}
    assert {s.parent.span_id for s in died + attempts} == {span.parent.span_id}
    assert all(s.status.status_code is StatusCode.ERROR for s in died)


def exit_after(started: str, marker: str) -> None:
    """A task that touches ``started``, then ends its worker process once ``marker``
    exists."""
    Path(started).touch()
    while not Path(marker).exists():
        time.sleep(0.01)
    os._exit(3)


def touch_and_wait(marker: str) -> None:
    Path(marker).touch()
    time.sleep(60)


@pytest.mark.parametrize(
    "key",
    [
        "数据" * 60 + "-1",  # 362 bytes of UTF-8, its prefix 360: more than a slot holds
        "exit-" + "x" * 240,  # longer than the slot keeps whole (with its prefix)
        "exit-" + "x" * 400,  # longer than otel.max-attribute-length
    ],
    ids=["wide", "long", "longer-than-an-attribute"],
)
def test_a_long_key_keeps_its_post_mortem(tmp_path, telemetry, monkeypatch, key):
    """An attempt's key and prefix of any length, beside another attempt (the next slot
    of the recorder): the death record names both keys (cut to fit, marked), each
    ``died`` span lies under the graph and links the scheduler's ``attempt`` span, and
    the Nanny leaves no recorder behind."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # this test's Nannies only
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    started, marker = str(tmp_path / "started"), str(tmp_path / "both-running")
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),
        in_process_cluster(
            n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1"
        ) as client,
    ):
        long = client.submit(exit_after, started, marker, key=key)
        while not Path(started).exists():  # the recorder's first slot is the long key's
            time.sleep(0.01)
        other = client.submit(touch_and_wait, marker, key="other-1")
        for future in (long, other):
            with pytest.raises(KilledWorker):
                future.result(timeout=120)
        client.wait_for_workers(1, timeout=120)
        flush_emitters(client)
    assert emitter.shared().flush(10)

    (death,) = [r for r in telemetry.logs() if r.event_name == "dask.worker.died"]
    (recorded,) = [k for k in death.attributes["dask.task.keys"] if k != "other-1"]
    # Whole, or cut where it had to be (with an ellipsis), at most an attribute's length.
    assert key.startswith(recorded.removesuffix("…"))
    assert recorded.endswith("…") == (recorded != key) and len(recorded) <= 256
    attempts = telemetry.spans("attempt ")
    died = telemetry.spans("died ")
    assert len(attempts) == len(died) == 2
    linked = sorted(link.context.span_id for s in died for link in s.links)
    assert linked == sorted(a.context.span_id for a in attempts)
    assert {s.parent.span_id for s in died} == {a.parent.span_id for a in attempts}
    assert_no_orphans(telemetry.spans())
    assert list(folders.root().iterdir()) == []  # the dead worker's recorder read, removed


def sleep_then_return(marker: str, seconds: float = 5) -> str:
    Path(marker).touch()
    time.sleep(seconds)
    return "done"


def providers_of(t: Telemetry) -> dict[str, object]:
    """``instrument(client, **providers_of(t))``: this process's Nannies export into ``t``."""
    return {
        "tracer_provider": t.tracer_provider,
        "meter_provider": t.meter_provider,
        "logger_provider": t.logger_provider,
    }


def test_instrumenting_a_running_cluster_reaches_its_nannies(tmp_path, monkeypatch):
    """``instrument(client)`` on a cluster already running: its Nannies get the plugin,
    and their workers (which get theirs after) a flight recorder."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    t = Telemetry()
    with in_process_cluster(processes=True, host="127.0.0.1") as client:
        dask_otel.instrument(client, **providers_of(t))
        try:
            marker = tmp_path / "started"
            future = client.submit(sleep_then_return, str(marker), key="sleep-1")
            while not marker.exists():
                time.sleep(0.05)
            (worker,) = [w for w, keys in client.processing().items() if "sleep-1" in keys]
            pid = client.run(os.getpid, workers=[worker])[worker]
            os.kill(pid, signal.SIGKILL)
            assert future.result(timeout=60) == "done"
            assert emitter.shared().flush(10)
        finally:
            dask_otel.uninstrument(client)
    (death,) = [r for r in t.logs() if r.event_name == "dask.worker.died"]
    assert death.attributes["dask.worker.death.signal"] == "SIGKILL"
    assert death.attributes["process.pid"] == pid
    assert death.attributes["dask.worker.address"] == worker
    assert death.attributes["dask.task.keys"] == ("sleep-1",)


def test_a_restart_is_not_a_death(tmp_path, telemetry, monkeypatch):
    """``client.restart()`` asks each Nanny to kill its worker (Nanny.kill over RPC): a
    worker that must be killed with SIGKILL because its task does not stop is no death."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        marker = tmp_path / "started"
        client.submit(sleep_then_return, str(marker), 30, key="sleep-1")
        while not marker.exists():
            time.sleep(0.05)
        client.restart()
        assert client.submit(len, "abc").result(timeout=60) == 3
        assert emitter.shared().flush(10)
    killed = [r for r in telemetry.logs() if "was killed by signal 9" in str(r.body)]
    assert killed  # the Nanny had to kill it
    assert not [r for r in telemetry.logs() if r.event_name == "dask.worker.died"]


async def block_event_loop(seconds: float) -> None:
    """Run by ``client.run`` on the worker's event loop: it cannot close meanwhile."""
    time.sleep(seconds)


def test_a_worker_its_closing_nanny_must_kill_is_no_death(telemetry, monkeypatch):
    """A Nanny that closes asks its worker to close and SIGKILLs it when it does not in
    time (on a loaded machine, say): no death to explain."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        client.run(block_event_loop, 60, wait=False)
    assert emitter.shared().flush(10)
    assert [r for r in telemetry.logs() if "still alive after" in str(r.body)]  # SIGKILLed
    assert not [r for r in telemetry.logs() if r.event_name == "dask.worker.died"]


class TouchOnTeardown(NannyPlugin):
    """Touches ``marker`` as its Nanny closes (after dask-otel's plugin, added first)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def teardown(self, nanny) -> None:
        Path(self.marker).touch()


async def exit_once_exists(marker: str, code: int) -> None:
    """Run by ``client.run`` on the worker's event loop: blocks it until ``marker``
    exists, then ends the process with ``code``."""
    while not Path(marker).exists():
        time.sleep(0.01)
    os._exit(code)


def test_a_worker_that_dies_while_its_nanny_closes_is_a_death(tmp_path, telemetry, monkeypatch):
    """A worker that exits with an error of its own once its Nanny has begun to close (and
    before the Nanny had to kill it) died: the close explains only the Nanny's SIGKILL. As
    when the scheduler hears of a death, and the cluster closes, before the Nanny does."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    marker = tmp_path / "closing"
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        client.register_plugin(TouchOnTeardown(str(marker)))
        (worker,) = client.scheduler_info()["workers"]
        pid = client.run(os.getpid)[worker]
        client.run(exit_once_exists, str(marker), 3, wait=False)
    assert emitter.shared().flush(10)
    assert [r for r in telemetry.logs() if f"{pid} exited with status 3" in str(r.body)]
    (death,) = [r for r in telemetry.logs() if r.event_name == "dask.worker.died"]
    assert death.attributes["dask.worker.death.cause"] == "exit"
    assert death.attributes["process.exit.code"] == 3
    assert death.attributes["process.pid"] == pid
    assert not [r for r in telemetry.logs() if "still alive after" in str(r.body)]  # not killed


def test_a_worker_killed_by_its_closing_nanny_after_uninstrument_is_no_death(monkeypatch, caplog):
    """``uninstrument(client)`` removes the Nanny's plugin but not its worker's exit
    callback (a worker that dies later still has its records sent): a worker that its
    Nanny, closing later, must SIGKILL is no death either."""
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    t = Telemetry()
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        dask_otel.instrument(client, **providers_of(t))
        dask_otel.uninstrument(client)
        client.run(block_event_loop, 60, wait=False)
    assert emitter.shared().flush(10)
    assert "still alive after" in caplog.text  # SIGKILLed
    assert not [r for r in t.logs() if r.event_name == "dask.worker.died"]


def test_a_nanny_cleans_up_after_one_that_is_gone(tmp_path, telemetry, monkeypatch):
    """A Nanny and its worker both SIGKILLed leave a directory and a recorder: the next
    Nanny on the machine sends what the worker had queued, and removes them."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # this test's Nannies only
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in ("TRACES", "METRICS", "LOGS"):  # worker processes export nowhere
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    orphan = folders.root() / "0123456789abcdef"
    orphan.mkdir(parents=True, mode=0o700)
    folders.root().chmod(0o700)
    run_child(orphan, spans=5)  # marks the directory as its own, dies with 5 spans queued
    # as a Nanny of a cluster that exports where this one does labels it
    labels.write(orphan, labels.Label(labels.destination()))
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        assert client.submit(len, "abc").result() == 3
        assert emitter.shared().flush(10)
        sent = telemetry.spans("span ")
    assert sorted(s.name for s in sent) == [f"span {i}" for i in range(5)]
    assert {s.resource.attributes["service.name"] for s in sent} == {"dask-worker"}
    assert not orphan.exists()
    assert list(folders.root().iterdir()) == []  # this test's Nanny cleaned up after itself
