"""The flight recorder: what a process queued for export survives its SIGKILL, and only
that (what it exported, or its full queue dropped, is not sent again)."""

from __future__ import annotations

import enum
import mmap
import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dask_otel import runtime as telemetry
from dask_otel.export import queued_spans, recorder_copy
from dask_otel.postmortem import flight_recorder, folders, rings
from dask_otel.spans import ids

#: A process that configures the SDK as a dask-otel worker does (exports held for a
#: minute), copies its queues to a flight recorder, makes spans and log records, and
#: kills itself with SIGKILL. argv: recorder path, spans, spans to flush first, logs, and
#: the size of one more span's attribute (0: no such span).
CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys
    from pathlib import Path
    from opentelemetry import trace
    from dask_otel.postmortem import flight_recorder, folders
    from dask_otel.signals import logs
    from dask_otel.export import drops, recorder_copy
    from dask_otel.distro import sdk
    from dask_otel import runtime as telemetry

    path, spans, flushed, records, big = sys.argv[1], *map(int, sys.argv[2:])
    path = path.format(pid=os.getpid())
    folders.own(Path(path).parent)  # as a Nanny marks its directory
    assert sdk.configure("worker")
    recorder = flight_recorder.FlightRecorder(Path(path), 1 << 20, 16)
    recorder.identify(**{"dask.worker.address": "tcp://worker:1"})
    assert recorder_copy.mirror(recorder) == {"traces", "logs"}
    slot = recorder.started("running-1", "running", "00-" + "1" * 32 + "-" + "2" * 16 + "-01", 7, 1)
    done = recorder.started("done-1", "done", None, 8, 2)
    recorder.ended(done)
    providers = telemetry.current()
    logs.install(providers.logger_provider, ("child",), logging.INFO)
    tracer = trace.get_tracer("child")
    for i in range(spans):
        with tracer.start_as_current_span(f"span {i}", attributes={"i": i}):
            pass
        if i + 1 == flushed:
            trace.get_tracer_provider().force_flush()
    if big:
        tracer.start_span("big", attributes={"blob": "x" * big}).end()
    for i in range(records):
        logging.getLogger("child").warning("record %d", i)
    # What the span queue holds as the process dies, taken while no export is under way
    # and none can start (its batch, out of the queue, is not exported yet).
    with recorder_copy.configured.processors[0].export_queue.held_still() as items:
        queued = [values[0] for values in items]
        dropped = drops.dropped().get(("traces", "queue_full"), 0)
        print("QUEUED", *queued, sep="|", file=sys.stderr, flush=True)
        print("DROPPED", dropped, file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def run_child(tmp_path, spans=0, flushed=0, records=0, big=0, **env):
    """(what the recorder held, what the span queue held, what was exported, how many
    spans the full queue dropped)."""
    path = tmp_path / "{pid}.flight"
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_LOGS_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "60000",
        "OTEL_BLRP_SCHEDULE_DELAY": "60000",
        **env,
    }
    args = [sys.executable, "-c", CHILD, str(path), *map(str, (spans, flushed, records, big))]
    out = subprocess.run(args, env=environ, capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("QUEUED")]
    (dropped,) = [line for line in out.stderr.splitlines() if line.startswith("DROPPED")]
    exported = re.findall(r'"name": "(span \d+)"', out.stdout)  # the console exporter's
    (path,) = tmp_path.glob("*.flight")
    return flight_recorder.read(path), line.split("|")[1:], exported, int(dropped.split()[1])


def recovered(wreck):
    """What ``recorder_copy.recover`` hands to this process's providers, exported in memory."""
    spans, records = InMemorySpanExporter(), InMemoryLogRecordExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(records))
    providers = telemetry.Providers(tracer_provider, NoOpMeterProvider(), logger_provider)
    handed = recorder_copy.recover(
        providers, wreck.objects, wreck.unexported_spans, wreck.unexported_logs
    )
    return handed, spans.get_finished_spans(), [r.log_record for r in records.get_finished_logs()]


def test_queued_spans_and_records_survive_sigkill(tmp_path):
    wreck, queued, exported, _ = run_child(tmp_path, spans=100, records=10)
    assert queued == [f"span {i}" for i in range(100)] and not exported
    assert wreck.identity == {"dask.worker.address": "tcp://worker:1"}
    handed, spans, records = recovered(wreck)
    assert handed == 100 + len(records)
    assert [s.name for s in spans] == [f"span {i}" for i in range(100)]
    assert spans[42].attributes == {"i": 42}
    assert {s.resource.attributes["service.name"] for s in spans} == {"dask-worker"}
    assert spans[0].instrumentation_scope.name == "child"
    mine = [r for r in records if str(r.body).startswith("record ")]
    assert [r.body for r in mine] == [f"record {i}" for i in range(10)]
    assert wreck.spans.lost() == wreck.logs.lost() == 0
    # The attempts: one executing, one finished whose span was never built.
    running, done = sorted(wreck.attempts, key=lambda a: a.key, reverse=True)
    assert (running.key, running.prefix, running.run_id, running.finished) == (
        "running-1",
        "running",
        7,
        False,
    )
    assert running.annotation.startswith("00-1111")
    assert (done.key, done.finished) == ("done-1", True)


def test_what_was_exported_is_not_sent_again(tmp_path):
    wreck, queued, exported, _ = run_child(tmp_path, spans=100, flushed=60)
    _, spans, _ = recovered(wreck)
    assert exported == [f"span {i}" for i in range(60)]
    assert [s.name for s in spans] == queued == [f"span {i}" for i in range(60, 100)]


def test_a_full_queue_neither_loses_nor_repeats(tmp_path):
    """A full queue drops the new spans (counted), never copied: the Nanny sends what the
    queue held, and no span exported is sent again."""
    wreck, queued, exported, dropped = run_child(
        tmp_path, spans=30, OTEL_BSP_MAX_QUEUE_SIZE="10", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="10"
    )
    _, spans, _ = recovered(wreck)
    sent = [s.name for s in spans]
    assert sent == queued and not set(sent) & set(exported)
    assert len(exported) + len(sent) + dropped == 30


def test_a_recorder_too_small_says_what_it_lost(tmp_path):
    batch = {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "65536"}  # nothing exported: all queued
    wreck, queued, _, _ = run_child(tmp_path, spans=20_000, **batch)
    _, spans, _ = recovered(wreck)
    assert [s.name for s in spans] == queued[len(queued) - len(spans) :]
    assert spans[-1].name == "span 19999"
    assert wreck.spans.lost() == len(queued) - len(spans) > 0


def test_a_span_larger_than_the_recorder_is_counted_lost(tmp_path):
    """A span too large for the recorder's ring (of a 1 MiB recorder) is not kept: the
    Nanny sends the others, and counts it lost."""
    wreck, queued, exported, _ = run_child(tmp_path, spans=3, big=2_000_000)
    assert queued == ["span 0", "span 1", "span 2", "big"] and not exported
    _, spans, _ = recovered(wreck)
    assert [s.name for s in spans] == ["span 0", "span 1", "span 2"]
    assert wreck.spans.lost() == 1


def test_a_record_too_large_for_the_ring_is_lost_only_if_not_exported():
    buffer = mmap.mmap(-1, 64 + 1000)
    ring = rings.Ring(buffer, 0, 64, 1000)
    numbers = [ring.append(b"a"), ring.append(b"b" * 2000), ring.append(b"c")]
    assert numbers == [0, 1, 2]
    contents = rings.read_ring(buffer, 0)
    assert [payload for _, _, payload in contents.records] == [b"a", b"c"]
    assert contents.lost() == 1
    ring.note_exported(2)  # the large one was exported
    assert rings.read_ring(buffer, 0).lost() == 0


@pytest.mark.parametrize("seed", range(10))
def test_an_attempt_of_any_key_stays_in_its_slot(tmp_path, seed):
    """Keys and prefixes of any length and any characters: each attempt is read back from
    its own slot, its key cut at a character boundary where it had to be, with the span
    id its carrier gives the whole key."""
    rng = random.Random(seed)
    alphabet = "ax-é数😀\ud800"
    recorder = flight_recorder.FlightRecorder(tmp_path / "1.flight", 1 << 20, 16)
    carrier = (
        "00-"
        + "1" * 32
        + "-"
        + "2" * 16
        + "-01;g=2;links="
        + ",".join(f"{i:032x}-{i:016x}" for i in range(1, rng.randint(1, 8)))
    )
    written = []
    for run_id in range(16):
        key = "".join(rng.choices(alphabet, k=rng.randint(0, 400)))
        prefix = "".join(rng.choices(alphabet, k=rng.randint(0, 400)))
        recorder.started(key, prefix, carrier, run_id, run_id)
        written.append((key, prefix))
    wreck = flight_recorder.read(tmp_path / "1.flight")
    assert wreck is not None
    attempts = sorted(wreck.attempts, key=lambda a: a.run_id)
    assert [a.run_id for a in attempts] == list(range(16))
    whole = ids.parse(carrier)
    for (key, prefix), attempt in zip(written, attempts, strict=True):
        for text, kept in ((key, attempt.key), (prefix, attempt.prefix)):
            assert kept == text or (kept.endswith("…") and text.startswith(kept[:-1]))
        if attempt.key != key:
            assert attempt.span_id == whole.span_id(key)
            assert ids.parse(attempt.annotation).generation == 2


@pytest.mark.parametrize("seed", range(20))
def test_ring_keeps_the_newest_records(seed):
    rng = random.Random(seed)
    size = rng.randint(64, 4000)
    buffer = mmap.mmap(-1, 64 + size)
    ring = rings.Ring(buffer, 0, 64, size)
    written = []
    for i in range(rng.randint(0, 500)):
        payload = bytes([i % 256]) * rng.randint(0, size // 3)
        ring.append(payload)
        written.append(payload)
    contents = rings.read_ring(buffer, 0)
    kept = [payload for _, _, payload in contents.records]
    assert kept == written[len(written) - len(kept) :]
    assert [number for number, _, _ in contents.records] == list(
        range(len(written) - len(kept), len(written))
    )
    assert sum(len(p) + 16 for p in kept) <= size
    # A record is forgotten only to make room: with the one before them (and padding
    # at the end of the ring, less than a record), the kept ones would not fit.
    if len(kept) < len(written):
        largest = max(len(p) + 16 for p in written)
        assert sum(len(p) + 16 for p in written[len(written) - len(kept) - 1 :]) + largest > size


def test_a_closed_nannys_cleanup_spares_the_next_one_at_its_address(tmp_path):
    """A Nanny's directory is named after its address, which a later Nanny may reuse: the
    old one's cleanup, late in the background, leaves the new one's directory alone (its
    worker would otherwise find none and record nothing for the post-mortem)."""
    folder = tmp_path / "nanny-at-a-reused-port"
    old = folders.own(folder)
    new = folders.own(folder)
    folders.disown(folder, old)
    assert folders.mark_of(folder) == new
    folders.disown(folder, new)
    assert not folder.exists()


class Level(enum.IntEnum):
    HIGH = 2


class Tag(str):
    pass


def test_subclasses_of_attribute_types_are_recorded_as_their_base_values(tmp_path):
    """marshal writes no IntEnum member or str subclass: the recorder keeps the values the
    exporters send (the base classes'), rather than nothing."""
    finished = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(finished))
    attributes = {"level": Level.HIGH, "tag": Tag("t"), "plain": True}
    provider.get_tracer("t").start_span("odd values", attributes=attributes).end()
    (span,) = finished.get_finished_spans()
    recorder = flight_recorder.FlightRecorder(tmp_path / "1.flight", 1 << 20, 16)
    values = queued_spans.compact(span, queued_spans.SharedObjects())
    assert recorder.span(values, span.resource, span.instrumentation_scope) == 0
    _, (sent,), _ = recovered(flight_recorder.read(tmp_path / "1.flight"))
    assert dict(sent.attributes) == {"level": 2, "tag": "t", "plain": True}
    assert [type(v) for v in sent.attributes.values()] == [int, str, bool]
