"""dask-otel summarize: real OTLP JSON (written by the SDK's file exporters), and bad input."""

from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from dask_otel.tools import cli
from dask_otel.tools.summary import SummaryError, summarize


@pytest.fixture
def recording(tmp_path):
    """A scheduler's spans of one computation with a failed task, as the SDK writes them."""
    path = tmp_path / "traces-scheduler-1.jsonl"
    provider = TracerProvider(resource=Resource({"service.name": "dask-scheduler"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    tracer = provider.get_tracer("dask_otel")
    with tracer.start_as_current_span("compute fail"), tracer.start_as_current_span("graph"):
        task = tracer.start_span("task fail", attributes={"dask.task.key": "fail-123"})
        task.add_event(
            "exception",
            {
                "exception.type": "ValueError",
                "exception.message": "injected",
                "dask.task.workers": ["tcp://a:1", "tcp://b:2"],
            },
        )
        task.set_attribute("dask.task.attempts", 2)
        task.set_status(Status(StatusCode.ERROR, "ValueError: injected"))
        task.end()
    provider.shutdown()
    return tmp_path


def test_summary_names_the_failure(recording, capsys):
    assert cli.main(["summarize", str(recording)]) == 0
    out = capsys.readouterr().out
    assert "Traces (1)" in out
    assert "task fail fail-123: ValueError: injected" in out
    assert "attempts 2, on tcp://a:1, tcp://b:2" in out
    assert "compute    dask-scheduler" in out


def test_truncated_file_is_read_up_to_the_damage(recording):
    (path,) = recording.glob("*.jsonl")
    with path.open("a") as stream:
        stream.write('{"resourceSpans": [{"scopeSpans": [{"spa')  # cut mid-write
    summary = summarize(recording)
    assert summary.spans == 3
    assert len(summary.skipped) == 1 and "not JSON (truncated?)" in summary.skipped[0]


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


def test_foreign_json(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}) + "\n[1, 2]\n")
    with pytest.raises(SummaryError, match="not an OTLP export request"):
        summarize(tmp_path / "other.json")
