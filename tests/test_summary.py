"""dask-otel summarize: golden output on a recorded real run, both trace models, several
paths, and lines it cannot read (truncated, foreign, hostile) skipped and reported."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import bin_path
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from dask_otel.tools import cli
from dask_otel.tools.report import elide, render
from dask_otel.tools.summary import SummaryError, summarize

DATA = Path(__file__).parent / "data"
#: Real runs recorded by tests/data/record_run.py (Nannies instrumented): trace model v2,
#: and the same workload before it (v1).
RUN = DATA / "run"
RUNS = [RUN, DATA / "run-v1"]


def text(*paths) -> str:
    out = io.StringIO()
    render(summarize(paths), out)
    return out.getvalue()


@pytest.mark.parametrize("run", RUNS, ids=["v2", "v1"])
def test_golden_summary_of_a_recorded_run(run):
    """Regenerate after a deliberate change of the output (and read the diff) with
    ``dask-otel summarize tests/data/run > tests/data/run.txt``."""
    assert text(run) == run.with_suffix(".txt").read_text()


@pytest.mark.parametrize("run", RUNS, ids=["v2", "v1"])
def test_the_golden_summary_answers_the_questions(run):
    """What the golden files must say, whatever their layout."""
    summary = summarize(run)
    out = text(run)
    failures = summary.failures()
    assert sorted(key.split("-")[0] for _, key, _ in failures) == ["die", "fail", "fail"]
    # Each failure: its trace, why, how many attempts, where.
    for trace_id, key, task in failures:
        assert trace_id in out and key in out
        assert task.exception and task.exception in out
    (die,) = [task for _, key, task in failures if key.startswith("die-")]
    assert "KilledWorker" in die.exception and max(die.attempts, die.counted) == 2
    assert "and because a dependency failed: 1 inc" in out
    # Counts agree with the failures listed.
    assert "3 failed, 1 failed because a dependency did" in out
    # Roles from each span's own process: the client's traces.
    assert out.count("dask-client ") == 7
    # Per worker, by name; movement; the task's ERROR record; the deaths.
    assert " w0 " in out and " w1 " in out
    assert "transfers between workers: 5 / " in out
    assert "record 3 is malformed, skipping it" in out
    assert "Workers that died (2):" in out
    # Every line fits a terminal, keys elided cleanly (the deaths quote log records).
    assert max(map(len, out.split("Workers that died")[0].splitlines())) <= 130


def test_a_run_that_lost_spans_says_so():
    """In the v2 recording the worker that ran `checksum` died (killed by `die`) before
    exporting that task's span: its transfer names a parent that is not there."""
    assert "- 2 span(s) name a parent that is not in the recording" in text(RUN)
    assert "4 log records arrived more than once (counted once)" in text(RUN)


def test_several_paths_and_directories_recursively(tmp_path):
    nested = tmp_path / "a" / "b"
    shutil.copytree(RUN, nested)
    one = next(nested.glob("traces-client-*.jsonl"))
    summary = summarize([tmp_path, one])  # the file twice: read once
    assert summary.files == len(list(RUN.iterdir()))
    assert summary.spans == summarize(RUN).spans


# -- both trace models -----------------------------------------------------------------------


#: The trace of the spans :func:`record` writes, under a parent it does not write.
PARENT = trace.set_span_in_context(
    trace.NonRecordingSpan(trace.SpanContext(0xABC, 0xDEF, True, trace.TraceFlags(1)))
)


def writing(path: Path, role: str) -> TracerProvider:
    """A provider whose spans the SDK's own OTLP JSON file exporter writes to ``path``, as
    a process of ``role``."""
    provider = TracerProvider(resource=Resource({"service.name": role}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    return provider


def record(path: Path, role: str, spans: list[dict]) -> None:
    """Spans written by the SDK's own OTLP JSON file exporter, as a process of ``role``."""
    provider = writing(path, role)
    tracer = provider.get_tracer("dask_otel")
    for spec in spans:
        span = tracer.start_span(spec["name"], PARENT, attributes=spec.get("attributes"),
                                 start_time=spec.get("start", 1_000_000_000))  # fmt: skip
        if "exception" in spec:
            span.add_event("exception", {"exception.type": "ValueError",
                                         "exception.message": spec["exception"]})  # fmt: skip
            span.set_status(Status(StatusCode.ERROR, spec["exception"]))
        span.end(spec.get("end", 2_000_000_000))
    provider.shutdown()


WORKER = {"dask.worker.address": "tcp://10.0.0.1:4000", "dask.worker.name": "w0"}


def test_trace_model_v2_reads_alike(tmp_path):
    """Worker ``task`` spans, ``attempt`` spans for failed attempts, the scheduler's
    ``task`` span only for the task no worker finished."""
    key = {"dask.task.key": "fail-1", "dask.task.prefix": "fail"}
    record(tmp_path / "traces-worker-1.jsonl", "dask-worker", [
        {"name": "task inc", "attributes": {"dask.task.key": "inc-1", "dask.task.prefix": "inc",
                                            "thread.id": 1, **WORKER}},
        {"name": "attempt fail", "attributes": {**key, "thread.id": 1, **WORKER},
         "exception": "boom"},
        {"name": "attempt fail", "attributes": {**key, "thread.id": 2, **WORKER},
         "exception": "boom again", "start": 2_500_000_000, "end": 3_000_000_000},
    ])  # fmt: skip
    record(tmp_path / "traces-scheduler-1.jsonl", "dask-scheduler", [
        {"name": "task fail", "attributes": {**key, "dask.task.state": "erred",
                                             "dask.task.attempts": 2}, "exception": "boom again"},
    ])  # fmt: skip
    summary = summarize(tmp_path)
    ((_, key_failed, task),) = summary.failures()
    assert (key_failed, task.attempts, task.failed_attempts) == ("fail-1", 2, 2)
    assert task.exception == "ValueError: boom again"
    worker = summary.workers["tcp://10.0.0.1:4000"]
    assert (worker.attempts, worker.failed) == (3, 2)
    out = text(tmp_path)
    assert "1 failed, 0 failed because a dependency did, 0 recovered on retry" in out
    assert "Gaps in the recording:" in out


def test_attempts_without_spans_are_reported(tmp_path):
    """A KilledWorker whose workers died before exporting their attempts' spans."""
    record(tmp_path / "traces-scheduler-1.jsonl", "dask-scheduler", [
        {"name": "task die", "attributes": {"dask.task.key": "die-1", "dask.task.prefix": "die",
                                            "dask.task.state": "erred", "dask.task.attempts": 3},
         "exception": "KilledWorker"},
    ])  # fmt: skip
    out = text(tmp_path)
    assert "3 attempt(s) of 1 failed task(s) have no span (die-1)" in out


# -- lines it cannot read ----------------------------------------------------------------------


HOSTILE = [
    '{"resourceSpans": [{"scopeSpans": [{"spa',  # cut mid-write
    json.dumps({"hello": "world"}),
    "[1, 2]",
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"x","traceId":"a","spanId":"b",'
    '"startTimeUnixNano":1e999,"endTimeUnixNano":2}]}]}]}',  # OverflowError
    "[" * 100_000 + "]" * 100_000,  # RecursionError
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"x","startTimeUnixNano":"soon"}]}]}]}',
    '{"resourceSpans": 5}',
    '{"resourceLogs":[{"scopeLogs":[{"logRecords":[{"severityNumber":"loud"}]}]}]}',
    '{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":"x","startTimeUnixNano":-5}]}]}]}',
    '{"resourceMetrics":[{"scopeMetrics":[{"metrics":[{"name":"dask_otel.exporter.dropped",'
    '"sum":{"dataPoints":[{"asDouble":NaN}]}}]}]}]}',
    "\x00\xff garbage",
]


def test_lines_it_cannot_read_are_skipped_and_reported(tmp_path):
    shutil.copytree(RUN, tmp_path / "run")
    (tmp_path / "hostile.jsonl").write_text("\n".join(HOSTILE) + "\n")
    summary = summarize(tmp_path)
    assert summary.skipped_count == len(HOSTILE)
    assert summary.spans == summarize(RUN).spans  # nothing of a bad line was counted
    reasons = " ".join(summary.skipped)
    assert "hostile.jsonl:1: not JSON (truncated?)" in reasons
    out = text(tmp_path)
    assert f"skipped {len(HOSTILE)} line(s) that could not be read" in out
    assert "OverflowError" in out and "nested too deep" in out
    assert "Failed tasks (3):" in out  # and the rest of the summary is there


def test_missing_path(tmp_path, capsys):
    assert cli.main(["summarize", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_directory_without_otlp_files(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SummaryError, match=r"no \.jsonl or \.json files"):
        summarize(tmp_path)


def test_empty_file(tmp_path):
    (tmp_path / "traces.jsonl").write_text("")
    with pytest.raises(SummaryError, match=r"no OTLP telemetry found .*empty"):
        summarize(tmp_path)


def test_only_foreign_json(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}) + "\n[1, 2]\n")
    with pytest.raises(SummaryError, match="not an OTLP export request"):
        summarize(tmp_path / "other.json")


@pytest.mark.parametrize(
    ("text_", "width", "expected"),
    [("short", 10, "short"), ("abcdefghij", 10, "abcdefghij"), ("abcdefghijk", 10, "abcde…hijk")],
)
def test_elide_keeps_both_ends(text_, width, expected):
    assert elide(text_, width) == expected


# -- the command line ------------------------------------------------------------------------


def dask_otel(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([bin_path("dask-otel"), *args], text=True, timeout=120, **streams)


def test_version_and_help():
    from dask_otel import __version__

    assert dask_otel("--version").stdout == f"dask-otel {__version__}\n"
    for command in ([], ["demo"], ["summarize"]):
        out = dask_otel(*command, "--help")
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and "`" not in out.stdout  # no reST in help
        # Every option and argument says what it is for.
        lines = out.stdout.split("options:", 1)[-1].splitlines()
        for i, line in enumerate(lines):
            if line.startswith("  -") or line.startswith("  PATH"):
                described = line.split(None, 2)[2:] or [lines[i + 1].strip()]
                assert described[0].strip(), (command, line)


def test_quiet_when_the_reader_goes_away():
    """``dask-otel summarize DIR | head``: no BrokenPipeError, no traceback."""
    head = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out = dask_otel("summarize", str(RUN), stdout=head.stdin)
    head.stdin.close()
    assert head.stdout.read().decode().startswith("11 file(s)")
    head.wait(10)
    assert out.stderr == ""


def test_summarize_several_paths_from_the_command_line(tmp_path):
    one, other = sorted(RUN.glob("traces-worker-*.jsonl"))
    out = dask_otel("summarize", str(one), str(other))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 file(s)")


def test_what_the_exporters_lost_is_reported(tmp_path):
    point = {
        "asInt": "219",
        "timeUnixNano": "5",
        "attributes": [
            {"key": "dask_otel.signal", "value": {"stringValue": "traces"}},
            {"key": "error.type", "value": {"stringValue": "export_failed"}},
        ],
    }
    metric = {"name": "dask_otel.exporter.dropped", "sum": {"dataPoints": [point]}}
    request = {"resourceMetrics": [{"scopeMetrics": [{"metrics": [metric]}]}]}
    (tmp_path / "metrics-worker-1.jsonl").write_text(json.dumps(request) + "\n")
    assert "the exporters said they lost 219 spans (export failed)" in text(tmp_path)


def test_computations_the_cluster_did_not_answer_are_gaps(tmp_path):
    """The client exported its ``compute`` spans; the scheduler and workers exported
    nothing (pointed elsewhere): not 'none found'."""
    client = writing(tmp_path / "traces-client-1.jsonl", "dask-client")
    tracer = client.get_tracer("dask_otel")
    for name in ("compute inc", "compute inc", "compute sum"):
        tracer.start_span(name).end()
    answered = tracer.start_span("compute mean")
    answered.end()
    halfway = tracer.start_span("compute max")
    halfway.end()
    client.shutdown()
    # The scheduler answered one, a worker (alone) another.
    for role, computation, child in [
        ("scheduler", answered, "graph"),
        ("worker", halfway, "task max"),
    ]:
        provider = writing(tmp_path / f"traces-{role}-1.jsonl", f"dask-{role}")
        parent = trace.set_span_in_context(trace.NonRecordingSpan(computation.get_span_context()))
        provider.get_tracer("dask_otel").start_span(child, parent).end()
        provider.shutdown()
    out = text(tmp_path)
    assert "Gaps in the recording: none found" not in out
    assert (
        "- 3 computation(s) have no spans from the cluster (compute inc x2, compute sum): "
        "is it exporting, and to where the client does?"
    ) in out
    assert "- 1 computation(s) have no graph span from the scheduler (compute max)" in out
    assert "compute mean" not in out.split("Gaps in the recording")[1]


def test_log_severities_by_enum_name_are_read(tmp_path):
    """Protobuf's JSON mapping may write enums by name, as it does a span's status."""
    records = [
        {"severityNumber": "SEVERITY_NUMBER_ERROR", "severityText": "ERROR", "body": {
            "stringValue": "by name"}},
        {"severityNumber": 17, "severityText": "ERROR", "body": {"stringValue": "by number"}},
        {"severityNumber": "SEVERITY_NUMBER_INFO2", "body": {"stringValue": "info"}},
    ]  # fmt: skip
    request = {"resourceLogs": [{"scopeLogs": [{"logRecords": records}]}]}
    (tmp_path / "logs.jsonl").write_text(json.dumps(request) + "\n")
    summary = summarize(tmp_path)
    assert summary.skipped_count == 0, summary.skipped
    assert summary.log_records == 3
    assert sorted(line for _, _, line in summary.errors) == ["by name", "by number"]


def test_a_path_that_is_not_a_directory_is_read_as_a_file():
    with pytest.raises(SummaryError, match=r"/dev/null: no OTLP telemetry found .*empty"):
        summarize("/dev/null")


def test_movement_in_the_unit_that_fits_sent_by_peers_and_retries_named(tmp_path):
    """740 bytes read back are ``740 B``, not ``0.0 MB``; a worker's ``sent`` counts the
    fetches of its peers, not of clients (its ``get_data`` spans serve both); tasks that
    recovered on retry are named."""
    peer = {"dask.worker.address": "tcp://10.0.0.2:4000", "dask.worker.name": "w1"}
    flaky = {"dask.task.key": "flaky-1", "dask.task.prefix": "flaky", "thread.id": 1, **WORKER}
    record(tmp_path / "traces-worker-1.jsonl", "dask-worker", [
        {"name": "transfer", "attributes": {**WORKER, "dask.transfer.bytes": 2_500,
                                            "dask.peer.address": peer["dask.worker.address"]}},
        {"name": "unspill x", "attributes": {**WORKER, "dask.spill.bytes": 740}},
        {"name": "attempt flaky", "attributes": flaky, "exception": "once"},
        {"name": "task flaky", "attributes": flaky, "start": 2_500_000_000, "end": 3_000_000_000},
    ])  # fmt: skip
    record(tmp_path / "traces-worker-2.jsonl", "dask-worker", [
        {"name": "get_data", "attributes": {**peer, "dask.transfer.bytes": 2_500}},
        {"name": "get_data", "attributes": {**peer, "dask.transfer.bytes": 1_000_000}},  # client
    ])  # fmt: skip
    out = text(tmp_path)
    assert "transfers between workers: 1 / 2.5 kB" in out
    assert "read back: 1 / 740 B" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  10.0.0.")}
    assert rows["10.0.0.1:4000"].split()[5:9] == ["1", "/", "2.5", "kB"]  # received
    assert rows["10.0.0.2:4000"].split()[5:11] == ["-", "1", "/", "2.5", "kB", "-"]  # sent
    assert "1 recovered on retry\n  recovered on retry: flaky-1\n" in out


def test_error_records_keep_their_reason():
    from dask_otel.tools.report import cut

    line = (
        "Task die-2d062b16416e29db4447dc8c08e8887b was lost with worker "
        "tcp://127.0.0.1:37537 (exited with status 1)"
    )
    assert (
        cut(line, 100)
        == "Task die-2d062b16… was lost with worker 127.0.0.1:37537 (exited with status 1)"
    )
    assert cut("Worker died: " + "x" * 100, 20) == "Worker died: xxxxxx…"


def test_a_task_rerun_after_its_worker_was_lost_is_no_recovery(tmp_path):
    """An attempt only the scheduler reports, lost with its worker (no run of its own, no
    Nanny's ``died`` span), may never have started there: its task ran again, it did not
    recover from a failure."""
    key = {"dask.task.key": "queued-1", "dask.task.prefix": "queued"}
    record(tmp_path / "traces-scheduler-1.jsonl", "dask-scheduler", [
        {"name": "attempt queued", "attributes": {**key, "dask.attempt.outcome": "worker-died",
                                                  "dask.worker.address": "tcp://10.0.0.9:1"},
         "exception": "worker died"},
    ])  # fmt: skip
    record(tmp_path / "traces-worker-1.jsonl", "dask-worker", [
        {"name": "task queued", "attributes": {**key, "thread.id": 1, **WORKER},
         "start": 2_500_000_000, "end": 3_000_000_000},
    ])  # fmt: skip
    out = text(tmp_path)
    assert "0 recovered on retry, 1 run again after their worker was lost\n" in out, out
