"""`dask-otel demo` end to end: real scheduler and worker processes, OTLP JSON files, the
summary; as on a fresh machine, where numpy is not installed."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import bin_path
from otlp_receiver import OTLPReceiver, StalledCollector, closed_port

from dask_otel.tools.summary import summarize

NO_NUMPY = 'raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n'


def run_demo(cwd, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``dask-otel demo --size small`` in ``cwd``, in every process of which numpy cannot be
    imported (dask-otel's own dependencies do not bring it)."""
    blocker = cwd / "no-numpy"
    (blocker / "numpy").mkdir(parents=True)
    (blocker / "numpy" / "__init__.py").write_text(NO_NUMPY)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    return subprocess.run(
        [bin_path("dask-otel"), "demo", "--size", "small", *args],
        env={**clean, "PYTHONPATH": str(blocker), **env},
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_demo_writes_files_and_summarizes_them(tmp_path):
    out = run_demo(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    files = sorted(p.name.split("-")[0:2] for p in (tmp_path / "dask-otel-telemetry").iterdir())
    for signal in ("traces", "metrics", "logs"):
        assert [signal, "scheduler"] in files
        assert files.count([signal, "worker"]) == 2
    # The client's process logs nothing (a file is made at its first line) and exports no
    # metrics: its last collection would be written at its exit, after the summary.
    assert [f for f in files if "client" in f] == [["traces", "client"]]
    # The summary printed at the end names the injected failure, with its retry.
    assert "demo failure on input 42" in out.stdout
    # The planned failure is the only ERROR: none from the cluster's shutdown.
    errors = [line for line in out.stdout.splitlines() if line.startswith("  ERROR x")]
    assert len(errors) == 1 and "Compute Failed" in errors[0], errors
    assert "2 attempt(s) on" in out.stdout
    assert "dask-otel summarize" in out.stdout
    assert "ModuleNotFoundError" not in out.stderr

    summary = summarize(tmp_path / "dask-otel-telemetry")
    assert not summary.skipped
    # The summary counted every file as it is once the demo has exited.
    counted = f"{summary.spans} spans, {summary.log_records} log records, "
    assert f"{counted}{summary.metric_points} metric points\n" in out.stdout
    roles = {role for _, role in summary.by_operation}
    assert roles == {"dask-client", "dask-scheduler", "dask-worker"}
    workers = summary.workers.values()
    assert sum(w.received[1] for w in workers) > 0  # bytes moved between the workers
    assert sum(w.spilled[1] for w in workers) > 0
    assert summary.severities["WARN"] >= 4  # the log lines written inside tasks
    ((_, key, failure),) = summary.failures()
    assert key.startswith("fail_always-") and failure.attempts == 2
    # Every computation is named after what it ran.
    roots = sorted(t.root for t in summary.traces.values())
    assert roots == [
        f"compute {name}"
        for name in ("checksum", "fail_always", "log_and_square", "mean", "random_block")
    ]
    assert "shutdown can only be called once" not in out.stdout + out.stderr


def test_demo_exports_to_a_collector(tmp_path):
    with OTLPReceiver() as receiver:
        out = run_demo(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "All telemetry was exported" in out.stdout
        # The traces are named after what ran, each rooted at the demo's client process.
        roots = {s["name"]: s for s in receiver.spans() if s["parent_span_id"] is None}
        for name in ("compute mean", "compute checksum", "compute fail_always"):
            assert roots[name]["resource"]["service.name"] == "dask-client"
    assert not (tmp_path / "dask-otel-telemetry").exists()


def test_demo_does_not_run_without_a_collector(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    out = run_demo(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    assert out.returncode == 2
    assert f"no OTLP collector at {endpoint} (Connection refused)" in out.stderr
    assert "did not run" in out.stderr
    assert "starting a scheduler" not in out.stdout
    assert "Traceback" not in out.stderr


def test_demo_says_what_a_hung_collector_lost(tmp_path):
    with StalledCollector() as collector:
        out = run_demo(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"Export to {collector.endpoint} FAILED" in out.stdout
    assert "could not finish exporting within 3 s" in out.stdout
    # How much: the spans the stalled processes still held (the demo's own, at least).
    held = re.search(r"what they still held \((\d+) spans", out.stdout)
    assert held and int(held[1]) > 0, out.stdout
    assert "All telemetry was exported" not in out.stdout
    assert "Look for" not in out.stdout
