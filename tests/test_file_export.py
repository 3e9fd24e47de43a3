"""OTLP JSON files (``otlp_json_file`` exporters with DASK_OTEL_FILE_EXPORT_DIR): one file
per signal and process, named after the process's Dask role; Python's helper processes
(the multiprocessing resource tracker, the forkserver) export nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import bin_path, start_scheduler, start_worker

from dask_otel.tools.summary import summarize

CLIENT = """
import sys
from distributed import Client
with Client(sys.argv[1]) as client:
    client.wait_for_workers(2)
    print(client.submit(sum, client.map(lambda x: x + 1, range(4))).result())
"""


def file_env(directory, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.pop("PYTHONPATH", None)
    exporters = {f"OTEL_{s}_EXPORTER": "otlp_json_file" for s in ("TRACES", "METRICS", "LOGS")}
    quick = {"OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    return {**env, **exporters, **quick, "DASK_OTEL_FILE_EXPORT_DIR": str(directory), **extra}


def resource_attribute(item: dict, key: str) -> str:
    (value,) = [
        a["value"]["stringValue"] for a in item["resource"]["attributes"] if a["key"] == key
    ]
    return value


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_files_are_named_by_role_and_helpers_write_none(processes, method):
    directory = processes.tmp_path / "telemetry"
    env = file_env(directory, DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=method)
    address = start_scheduler(processes, env)
    for name in ("w0", "w1"):
        start_worker(processes, env, address, name)
    client = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, "-c", CLIENT, address],
        env=env, capture_output=True, text=True, timeout=180, cwd=processes.tmp_path,
    )  # fmt: skip
    assert client.returncode == 0, client.stderr + processes.logs()
    assert client.stdout.strip() == "10"
    for proc, _ in processes.procs:
        processes.stop(proc)  # a graceful stop: every process exports what it holds

    files = sorted(p.name for p in directory.iterdir())
    roles = {name.split("-")[1] for name in files}
    assert roles == {"scheduler", "nanny", "worker", "client"}, files
    # Each file's resource names its role: from the first line on for spans; log records
    # and metrics a process made before it knew its role (a Nanny's worker starting, a
    # client before its first submission) have none yet, never another one.
    for path in directory.iterdir():
        signal, role = path.name.split("-")[:2]
        names = [
            resource_attribute(item, "service.name")
            for line in path.read_text().splitlines()
            for item in next(iter(json.loads(line).values()))
        ]
        assert names[-1] == f"dask-{role}", path.name
        if signal == "traces":
            assert set(names) == {f"dask-{role}"}, path.name
        assert {n for n in names if n.startswith("dask-")} == {f"dask-{role}"}, path.name
    summary = summarize(directory)
    assert not summary.skipped
    assert {role for _, role in summary.by_operation} >= {"dask-client", "dask-worker"}
