"""``dask-otel demo``: a short, realistic Dask run with everything dask-otel records.

Starts an instrumented ``LocalCluster`` with worker processes and runs: an array
reduction that moves data between workers, a phase that spills to disk, a failing task
with a retry, and log lines written inside tasks. Exports to ``OTEL_EXPORTER_OTLP_ENDPOINT``
when it is set, otherwise writes OTLP JSON files (the collector's file exporter format)
and ends with their summary.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import dask
import dask.array as da
from distributed import Client, LocalCluster

from dask_otel import DaskInstrumentor, summary, telemetry
from dask_otel.sdk import FILE_EXPORT_DIR

#: Per size: (edge, chunk) of the reduction, (edge, chunk) of the persist that spills,
#: and the workers' memory limit (they spill past 30% of it).
SIZES = {
    "normal": ((4000, 500), (6000, 1000), "400MiB"),
    "small": ((800, 200), (3000, 500), "100MiB"),
}


def log_and_square(x: int) -> int:
    logging.getLogger("dask_otel.demo.task").warning("squaring %d inside a task", x)
    return x * x


def fail_always(x: int) -> int:
    raise ValueError(f"demo failure on input {x}")


def _file_mode(directory: Path) -> None:
    """Route all three signals of every process of the demo to OTLP JSON files."""
    os.environ[FILE_EXPORT_DIR] = str(directory)
    for signal in ("TRACES", "METRICS", "LOGS"):
        os.environ[f"OTEL_{signal}_EXPORTER"] = "otlp_json_file"
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "2000")
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")


def _step(out: TextIO, text: str) -> float:
    out.write(f"  {text} ...")
    out.flush()
    return time.perf_counter()


def _done(out: TextIO, started: float, detail: str = "") -> None:
    out.write(f" done in {time.perf_counter() - started:.1f} s{detail}\n")


def run(output: Path, size: str = "normal", out: TextIO = sys.stdout) -> int:
    """Run the demo; returns the process exit code."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    output = output.resolve()
    if endpoint:
        out.write(f"dask-otel demo: exporting to {endpoint}\n")
    else:
        output.mkdir(parents=True, exist_ok=True)
        for signal in ("traces", "metrics", "logs"):
            for old in output.glob(f"{signal}-*.jsonl"):  # an earlier demo's files only
                old.unlink()
        _file_mode(output)
        out.write(f"dask-otel demo: writing OTLP JSON files to {output}\n")
    (edge, chunk), (spill_edge, spill_chunk), memory_limit = SIZES[size]
    DaskInstrumentor().instrument()
    spill_config = {
        # Small limits so the persist below goes to disk once 30% of the limit is held;
        # no memory monitor, whose process-wide thresholds would fire at once.
        "distributed.worker.memory.target": 0.3,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    started = _step(out, "starting a LocalCluster with 2 worker processes")
    with (
        dask.config.set(spill_config),
        LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            memory_limit=memory_limit,
            host="127.0.0.1",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        _done(out, started)
        started = _step(out, f"array reduction, {edge}x{edge} in {chunk}-chunks, across workers")
        x = da.random.default_rng(1).random((edge, edge), chunks=chunk)
        total = float((x @ x.T).mean().compute())
        _done(out, started, f" (mean {total:.1f})")

        started = _step(out, f"persisting {spill_edge**2 * 8 / 2**20:.0f} MiB, more than fits")
        y = (da.ones((spill_edge, spill_edge), chunks=spill_chunk) * 2).persist()
        checksum = float(y.sum().compute())
        del y
        _done(out, started, f" (sum {checksum:.0f})")

        started = _step(out, "tasks that log")
        squares = client.gather(client.map(log_and_square, range(4)))
        _done(out, started, f" ({squares})")

        started = _step(out, "a task that fails, with one retry")
        try:
            client.submit(fail_always, 42, retries=1).result()
        except ValueError as e:
            _done(out, started, f" (failed as planned: {e})")
        started = _step(out, "closing the cluster and flushing telemetry")
    providers = telemetry.current()
    DaskInstrumentor().uninstrument()
    for provider in (
        providers.tracer_provider,
        providers.meter_provider,
        providers.logger_provider,
    ):
        shutdown = getattr(provider, "shutdown", None)  # last export, files closed
        if shutdown is not None:
            shutdown()
    _done(out, started)
    if endpoint:
        out.write(
            "\nLook for the services dask-scheduler and dask-worker in your tracing backend"
            " (Jaeger, Tempo, ...): one trace per computation above.\n"
        )
        return 0
    out.write("\n")
    summary.render(summary.summarize(output), out)
    out.write(
        f"\nThe files are in {output}. Summarize them again with\n"
        f"  dask-otel summarize {output}\n"
        "Replay them into Jaeger or Tempo through a collector's otlpjsonfile receiver:\n"
        "  receivers: {otlpjsonfile: {include: ['" + str(output) + "/*.jsonl']}}\n"
    )
    return 0
