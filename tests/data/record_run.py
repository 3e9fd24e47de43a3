"""Record the telemetry of a small, real Dask run into OTLP JSON files, for the golden
tests of ``dask-otel summarize`` (tests/test_summary.py).

    python tests/data/record_run.py tests/data/run

A ``dask scheduler`` and two ``dask worker`` processes (with Nannies) on 127.0.0.1, all
instrumented by ``dask_otel.instrument(client)`` from this process, write traces and
WARNING and ERROR log records as OTLP JSON lines (no metrics: the summary does not
count from them). The workload
has one of everything the summary reports: a reduction whose data moves between the
workers, a task that fails twice (``retries=1``), a task that fails because its
dependency did, an ERROR record logged by a task, a persist that spills, and a task that
kills its worker twice (``KilledWorker``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from dask import delayed
from distributed import Client, KilledWorker

import dask_otel

ENV = {
    "OTEL_TRACES_EXPORTER": "otlp_json_file",
    "OTEL_LOGS_EXPORTER": "otlp_json_file",
    "OTEL_METRICS_EXPORTER": "none",
    "DASK_OTEL__LOGS__LEVEL": "WARNING",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "OTEL_BLRP_SCHEDULE_DELAY": "200",
    "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1",
    "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.3",
    "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE": "False",
}


def block(seed: int, size: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(size))


def concat(left: bytes, right: bytes) -> bytes:
    return left + right


def mean(data: bytes) -> float:
    return sum(data) / len(data)


def fail(x: int) -> int:
    raise ValueError(f"cannot process {x}")


def inc(x: int) -> int:
    return x + 1


def log_error(x: int) -> int:
    logging.getLogger("record_run").error("record %d is malformed, skipping it", x)
    return x


def die(x: int) -> int:
    os._exit(1)


def checksum(blocks: list[bytes]) -> int:
    return sum(zlib.crc32(b) for b in blocks) % 2**32


def main(output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    for old in output.glob("*.jsonl"):
        old.unlink()
    env = {**os.environ, **ENV, "DASK_OTEL_FILE_EXPORT_DIR": str(output.resolve())}
    os.environ.update(env)
    with tempfile.TemporaryDirectory() as work:
        scheduler_file = Path(work) / "scheduler.json"
        common = ["--host", "127.0.0.1", "--scheduler-file", str(scheduler_file)]
        dask = [sys.executable, "-m", "dask"]
        scheduler = [*dask, "scheduler", "--port", "0", "--no-dashboard", *common]
        processes = [subprocess.Popen(scheduler, env=env)]
        while not scheduler_file.exists():
            time.sleep(0.1)
        for name in ("w0", "w1"):
            worker = [*dask, "worker", "--nthreads", "1", "--name", name, "--no-dashboard"]
            worker += ["--memory-limit", str(32 * 2**20), *common]
            processes.append(subprocess.Popen(worker, env=env))
        address = json.loads(scheduler_file.read_text())["address"]
        with Client(address) as client:
            client.wait_for_workers(2)
            dask_otel.instrument(client)
            run(client)
            client.shutdown()
        for process in processes:  # a Nanny may outlive the scheduler: SIGTERM it
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()


def run(client: Client) -> None:
    blocks = [delayed(block)(i, 200_000) for i in range(4)]
    left, right = delayed(concat)(blocks[0], blocks[1]), delayed(concat)(blocks[2], blocks[3])
    print("mean", delayed(mean)(delayed(concat)(left, right)).compute())
    try:
        client.submit(fail, 1, retries=1).result()
    except ValueError as e:
        print("failed twice:", e)
    try:
        delayed(inc)(delayed(fail)(2)).compute()
    except ValueError as e:
        print("failed with its dependency:", e)
    print("logged:", client.submit(log_error, 3).result())
    persisted = client.persist([delayed(block)(i, 2**20) for i in range(12)])
    print("checksum", delayed(checksum)(persisted).compute())
    del persisted
    try:
        client.submit(die, 1).result()
    except KilledWorker as e:
        print("killed worker:", e)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
