"""`dask-otel demo` end to end: real worker processes, OTLP JSON files, the summary."""

from __future__ import annotations

import os
import subprocess

from conftest import bin_path

from dask_otel.summary import summarize


def test_demo_writes_files_and_summarizes_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    out = subprocess.run(
        [bin_path("dask-otel"), "demo", "--size", "small"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    files = sorted(p.name.split("-")[0:2] for p in (tmp_path / "dask-otel-telemetry").iterdir())
    for signal in ("traces", "metrics", "logs"):
        assert [signal, "scheduler"] in files
        assert files.count([signal, "worker"]) == 2
    # The summary printed at the end names the injected failure, with its retry.
    assert "demo failure on input 42" in out.stdout
    assert "attempts 2" in out.stdout
    assert "dask-otel summarize" in out.stdout

    summary = summarize(tmp_path / "dask-otel-telemetry")
    assert not summary.skipped
    roles = {role for _, role in summary.by_operation}
    assert roles == {"dask-scheduler", "dask-worker"}
    assert summary.metric_total("dask.worker.transfer.received") > 0
    assert summary.metric_total("dask.worker.spill.size", "disk-write") > 0
    assert summary.severities["WARN"] >= 4  # the log lines written inside tasks
    (failure,) = summary.failures
    assert failure["attempts"] == 2 and len(set(failure["workers"])) >= 1
