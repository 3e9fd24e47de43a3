"""Stderr stays as it is: what plain Python and Dask print, they print with dask-otel too.

Real processes, no logging configured by the user: each way in runs the same probe
(tests/scripts/stderr_probe.py) plain and with dask-otel, and what the client, the
scheduler, the worker and its Nanny print is compared (the probe's records line by line,
on the same stream; Dask's own records by logger and level).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import HERE, Processes, bin_path, otel_env, scheduler_address, wait_for_file
from otlp_receiver import closed_port

PROBE = str(HERE / "scripts" / "stderr_probe.py")
OTEL = bin_path("opentelemetry-instrument")
#: A record of Dask's own stderr handler: time, logger, level, message.
DASK_LINE = re.compile(r"^[\d-]+ [\d:,]+ - (distributed[\w.]*) - (\w+) - ")
#: Dask's INFO records of a run, whatever its timing.
MAIN_INFO = (
    "distributed.scheduler - INFO - Register worker",
    "distributed.scheduler - INFO - Receive client connection",
    "distributed.worker - INFO -       Start worker at:",
    "distributed.nanny - INFO -         Start Nanny at:",
)


class Run:
    """What one run printed: the client's stdout and stderr, the servers' output."""

    def __init__(self, out: subprocess.CompletedProcess, servers: str) -> None:
        assert out.returncode == 0, out.stdout + out.stderr + servers
        assert "probe: done" in out.stdout
        self.stdout = out.stdout
        self.stderr = out.stderr
        self.all = out.stderr + servers

    def probes(self, text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if "probe: " in line)

    def dask(self, *levels: str) -> set[tuple[str, str]]:
        """(logger, level) of Dask's own records at ``levels``."""
        return {
            m.groups()
            for line in self.all.splitlines()
            if (m := DASK_LINE.match(line)) and m.group(2) in levels
        }


def compare(plain: Run, traced: Run) -> None:
    assert traced.probes(traced.stderr) == plain.probes(plain.stderr)
    assert traced.probes(traced.all) == plain.probes(plain.all)
    assert "probe: " not in traced.stdout.replace("probe: done", "")
    # Dask's own warnings and errors, by logger: none lost, none added (a plugin failing
    # at close, say). Its INFO records depend on timing at shutdown: the main ones.
    problems = ("WARNING", "ERROR", "CRITICAL")
    assert traced.dask(*problems) == plain.dask(*problems)
    assert ("distributed.worker", "ERROR") in plain.dask(*problems)  # "Compute Failed"
    for info in MAIN_INFO:
        assert (info in plain.all) == (info in traced.all), info
    # Every process said its warning; nothing below WARNING was printed.
    for where in ("client", "task", "worker", "nanny", "scheduler"):
        assert f"probe: {where} warning" in plain.all
    assert "WARNING:root:probe: root-level warning" in plain.stderr
    assert "WARNING:probe.after-basic-config:probe: after-basic-config warning" in plain.stderr
    assert "not printed" not in plain.all


def client(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=180, cwd=cwd
    )  # fmt: skip


def cluster(procs: Processes, env: dict[str, str], wrap: Callable[[list[str]], list[str]]) -> str:
    """A scheduler and a Nanny worker, each command passed through ``wrap``."""
    scheduler_file = procs.tmp_path / "scheduler.json"
    dask = bin_path("dask")
    procs.start(
        wrap([dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(scheduler_file)]),
        env, "scheduler",
    )  # fmt: skip
    wait_for_file(scheduler_file, procs)
    procs.start(
        wrap([dask, "worker", "--scheduler-file", str(scheduler_file), "--host", "127.0.0.1",
              "--nthreads", "1", "--no-dashboard"]),
        env, "worker",
    )  # fmt: skip
    return scheduler_address(scheduler_file, procs)


def run_way_in(tmp_path: Path, env: dict[str, str], instrumented: bool, way: str) -> Run:
    procs = Processes(tmp_path / ("traced" if instrumented else "plain"))
    procs.tmp_path.mkdir(parents=True)
    try:
        if way == "local":
            args = [sys.executable, PROBE, "local", *(["--instrument"] if instrumented else [])]
            return Run(client(args, env, procs.tmp_path), "")
        if way == "zero-code":
            wrap = (lambda c: [OTEL, *c]) if instrumented else (lambda c: c)
            address = cluster(procs, env, wrap)
            args = wrap([sys.executable, PROBE, address])
        else:  # Dask's preloads for the servers, import and configure in the client
            preload = ["--preload", "dask_otel"]
            nanny = ["--preload-nanny", "dask_otel"]
            address = cluster(
                procs,
                env,
                lambda c: (
                    c + (preload + (nanny if c[1] == "worker" else [])) if instrumented else c
                ),
            )
            args = [sys.executable, PROBE, address, *(["--instrument"] if instrumented else [])]
        out = client(args, env, procs.tmp_path)
        for proc, _ in procs.procs:
            procs.stop(proc)
        return Run(out, procs.logs())
    finally:
        procs.stop_all()


def check_way_in(tmp_path: Path, env: dict[str, str], way: str) -> Run:
    """Runs ``way`` plain and with dask-otel, compares; returns the plain run."""
    plain = run_way_in(tmp_path, env, False, way)
    compare(plain, run_way_in(tmp_path, env, True, way))
    return plain


def test_zero_code(receiver, tmp_path):
    check_way_in(tmp_path, otel_env(receiver), "zero-code")


def test_preload_and_import_and_configure(receiver, tmp_path):
    check_way_in(tmp_path, otel_env(receiver), "preload")


def test_local_cluster_and_the_collector_down(receiver, tmp_path):
    """A ``LocalCluster`` of worker processes, instrumented from the client; then with no
    collector listening: what plain Python prints does not depend on one, and dask-otel's
    own word that spans were lost reaches the terminal too. (Dask's own lines are not
    compared there: how long a worker's exit waits for a collector that is down is the
    other half of issue 21.)"""
    plain = check_way_in(tmp_path / "up", otel_env(receiver), "local")
    down = run_way_in(
        tmp_path / "down", otel_env_to(f"http://127.0.0.1:{closed_port()}"), True, "local"
    )
    assert down.probes(down.stderr) == plain.probes(plain.stderr)
    # Said at exit, counting what was lost on the way and what was still queued: the
    # "spans lost" line of a failed batch comes only if a batch failed before the exit.
    assert re.search(r"^dask-otel: .*\b\d+ spans\b.* not exported", down.stderr, re.MULTILINE)


def otel_env_to(endpoint: str) -> dict[str, str]:
    class Nowhere:
        grpc_endpoint = endpoint

    return otel_env(Nowhere(), OTEL_EXPORTER_OTLP_TIMEOUT="1")  # type: ignore[arg-type]
