"""The pipeline and the Dask cluster of the real-backend tests, each role a host of its own.

Hosts: ``collector`` (the OpenTelemetry Collector run with collector-config.yaml itself),
``jaeger``, ``tempo`` (a second Jaeger standing in for Tempo, which is not built here),
``prometheus``, ``victorialogs``, ``scheduler``, ``worker-a`` and ``worker-b`` (each a
``dask worker --nworkers 2`` with its Nanny; ``worker-b`` exports over OTLP/HTTP, the rest
over OTLP/gRPC) and ``client``. Dask processes start as README says, under
``opentelemetry-instrument``, with nothing but ``OTEL_*`` variables and Dask config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hosts import Process, TestNetwork

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

#: Worker memory: a task touching JOB_HOG_BYTES gets its worker killed by the Nanny; the
#: spill target is low enough that the job's arrays spill.
WORKER_MEMORY_LIMIT = "600MiB"
HOG_BYTES = 800 * 2**20


def build_backends() -> dict[str, str]:
    """Build (or take from the cache) every backend; their paths by name."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/backends.sh")], check=True, capture_output=True, text=True
    )
    return dict(line.split("=", 1) for line in result.stdout.split())


def http_get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def http_text(url: str, **query: str) -> str:
    if query:
        url += "?" + urllib.parse.urlencode(query)
    return http_get(url).decode()


def http_json(url: str, **query: str) -> Any:
    return json.loads(http_text(url, **query))


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """Poll ``check`` until it returns something true; its last error in the message."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as error:  # the service is not up yet
            last = error
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout} s (last error: {last!r})")


@dataclass
class Stack:
    """The running hosts and where to ask each backend."""

    network: TestNetwork
    binaries: dict[str, str]
    workdir: Path
    collector: Process | None = None

    def url(self, host: str, port: int, path: str = "") -> str:
        return f"http://{self.network.hosts[host].address}:{port}{path}"

    # -- the pipeline ---------------------------------------------------------------------

    def start_pipeline(self) -> None:
        # Jaeger traces itself to its own receiver unless told not to.
        jaeger_env = {
            **self.base_env(),
            "JAEGER_LISTEN_HOST": "0.0.0.0",
            "OTEL_TRACES_SAMPLER": "always_off",
        }
        for host in ("jaeger", "tempo"):
            self.network.start(host, [self.binaries["jaeger"]], jaeger_env, host)
        data = self.workdir / "prometheus-data"
        self.network.start(
            "prometheus",
            [
                self.binaries["prometheus"],
                f"--config.file={ROOT / 'deploy/prometheus/prometheus.yml'}",
                f"--storage.tsdb.path={data}",
                "--web.listen-address=0.0.0.0:9090",
                "--web.enable-otlp-receiver",
                "--enable-feature=exemplar-storage",
            ],
            self.base_env(),
            "prometheus",
        )
        self.network.start(
            "victorialogs",
            [
                self.binaries["victorialogs"],
                f"-storageDataPath={self.workdir / 'victorialogs-data'}",
                "-httpListenAddr=:9428",
            ],
            self.base_env(),
            "victorialogs",
        )
        for host, port, path in (
            ("jaeger", 16686, "/api/services"),
            ("tempo", 16686, "/api/services"),
            ("prometheus", 9090, "/-/ready"),
            ("victorialogs", 9428, "/health"),
        ):
            wait_until(lambda h=host, p=port, q=path: http_get(self.url(h, p, q)), host)
        self.start_collector(sampling_percentage=100)

    def start_collector(self, sampling_percentage: int) -> None:
        """(Re)start the collector with collector-config.yaml, endpoints from its variables."""
        if self.collector is not None:
            self.network.stop(self.collector)
        env = {
            **self.base_env(),
            "TAIL_SAMPLING_PERCENTAGE": str(sampling_percentage),
            "TAIL_SAMPLING_DECISION_WAIT": "5s",
            "DEPLOYMENT_ENVIRONMENT": "backends-test",
            "LOGS_OTLP_ENDPOINT": "http://victorialogs:9428/insert/opentelemetry",
        }
        label = f"collector-{sampling_percentage}"
        self.collector = self.network.start(
            "collector",
            [self.binaries["otelcol"], f"--config={ROOT / 'collector-config.yaml'}"],
            env,
            label,
        )
        wait_until(lambda: http_get(self.url("collector", 13133)), "the collector's health")

    def collector_metrics(self) -> str:
        return http_get(self.url("collector", 8888, "/metrics")).decode()

    # -- the cluster ----------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "GOCACHE")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        env["TMPDIR"] = str(self.workdir / "tmp")
        (self.workdir / "tmp").mkdir(exist_ok=True)
        return env

    def dask_env(self, protocol: str = "grpc") -> dict[str, str]:
        env = {
            **self.base_env(),
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
            "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1",
            "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.02",
            "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "0.5",
        }
        if protocol == "grpc":
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector:4317"
        else:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector:4318"
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        return env

    def start_cluster(self) -> None:
        instrument = str(BIN / "opentelemetry-instrument")
        self.network.start(
            "scheduler",
            [instrument, "dask", "scheduler", "--host", "scheduler", "--dashboard-address", ":0"],
            self.dask_env(),
            "scheduler",
        )
        for host, protocol in (("worker-a", "grpc"), ("worker-b", "http")):
            self.network.start(
                host,
                [
                    instrument, "dask", "worker", "tcp://scheduler:8786", "--host", host,
                    "--nworkers", "2", "--nthreads", "2", "--dashboard-address", ":0",
                    "--memory-limit", WORKER_MEMORY_LIMIT,
                ],
                self.dask_env(protocol),
                host,
            )  # fmt: skip

    def run_client(self, script: Path, *args: str, label: str, timeout: float = 300) -> Process:
        """Run ``script`` on the client host under opentelemetry-instrument, to its end."""
        env = {**self.dask_env(), "JOB_HOG_BYTES": str(HOG_BYTES)}
        env["JOB_FLAKY_MARK"] = str(self.workdir / "flaky-mark")
        argv = [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(script), *args]
        process = self.network.start("client", argv, env, label)
        try:
            process.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.network.stop(process)
            raise AssertionError(
                f"{label} did not finish in {timeout} s:\n{process.tail()}"
            ) from None
        assert process.popen.returncode == 0, f"{label} failed:\n{process.tail()}"
        return process
