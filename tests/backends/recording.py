"""One recording for every real-backend test: the hosts, the pipeline, the job, the probes.

The job runs with the collector keeping every trace; then the collector restarts keeping
SAMPLED_PERCENTAGE of the traces without errors and the probe computations run. The
cluster is stopped gracefully (its processes flush) before the tests ask the backends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hosts import TestNetwork
from stack import Stack, build_backends, http_json, http_text

HOSTS = (
    "collector", "jaeger", "tempo", "prometheus", "victorialogs",
    "scheduler", "worker-a", "worker-b", "client",
)  # fmt: skip
SAMPLED_PERCENTAGE = 50
JOB = Path(__file__).with_name("job.py")


@dataclass
class Recording:
    stack: Stack
    #: what the job computed and how each computation ended
    outcome: dict[str, Any]
    #: Jaeger's traces (its UI API: adjusted, with warnings) of the job, by trace id
    traces: dict[str, dict[str, Any]]
    #: the same for the probe computations run under sampling
    probe_traces: dict[str, dict[str, Any]]
    #: the collector's own metrics (Prometheus text) at the end of each run
    collector_metrics: list[str]

    def worker_traces(self, select: str) -> dict[str, dict[str, Any]]:
        """Jaeger's traces rooted by a ``dask-worker`` span named ``select...``."""
        return traces_of(self.stack, "dask-worker", select)

    def prometheus(self, promql: str) -> list[dict[str, Any]]:
        url = self.stack.url("prometheus", 9090, "/api/v1/query")
        return http_json(url, query=promql)["data"]["result"]

    def logs(self, logsql: str) -> list[dict[str, Any]]:
        url = self.stack.url("victorialogs", 9428, "/select/logsql/query")
        text = http_text(url, query=logsql, limit="10000")
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def traces_of(stack: Stack, service: str, select: str) -> dict[str, dict[str, Any]]:
    """Jaeger's traces with a ``service`` span whose operation starts with ``select``."""
    data = http_json(
        stack.url("jaeger", 16686, "/api/traces"),
        service=service,
        limit="5000",
        lookback="1h",
    )["data"]
    found = {}
    for trace in data:
        names = {span["operationName"] for span in trace["spans"]}
        if any(name.startswith(select) for name in names):
            found[trace["traceID"]] = trace
    return found


def settled(stack: Stack, select: str, quiet: float = 8) -> dict[str, dict[str, Any]]:
    """Jaeger's traces once their span count has not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + 180
    last_count, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        traces = traces_of(stack, "dask-client", select)
        count = sum(len(t["spans"]) for t in traces.values())
        if count != last_count:
            last_count, last_change = count, time.monotonic()
        elif count and time.monotonic() - last_change >= quiet:
            return traces
        time.sleep(2)
    raise TimeoutError(f"Jaeger's traces of {select!r} did not settle: {last_count} spans")


@contextmanager
def record(workdir: Path) -> Iterator[Recording]:
    """Hosts, pipeline and cluster up; the job and the probes run; torn down at exit."""
    binaries = build_backends()
    network = TestNetwork(workdir)
    try:
        for host in HOSTS:
            network.add(host)
        stack = Stack(network, binaries, workdir)
        stack.start_pipeline()
        stack.start_cluster()
        job_out = workdir / "job.json"
        stack.run_client(JOB, "job", "tcp://scheduler:8786", str(job_out), label="job")
        traces = settled(stack, "compute")
        metrics = [stack.collector_metrics()]
        stack.start_collector(sampling_percentage=SAMPLED_PERCENTAGE)
        probes_out = workdir / "probes.json"
        stack.run_client(JOB, "probes", "tcp://scheduler:8786", str(probes_out), label="probes")
        for process in list(network.processes):
            if process.host.name in ("scheduler", "worker-a", "worker-b"):
                network.stop(process, timeout=60)
        probe_traces = settled(stack, "compute sampling_probe")
        metrics.append(stack.collector_metrics())
        outcome = json.loads(job_out.read_text())
        yield Recording(stack, outcome, traces, probe_traces, metrics)
    finally:
        network.close()
