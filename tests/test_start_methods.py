"""``dask_otel.instrument()`` in a script that starts ``LocalCluster(processes=True)``:
the Nannies' worker processes export their spans, log records and metrics with every
multiprocessing method Dask offers (``distributed.worker.multiprocessing-method``).

A worker the forkserver starts shares the forkserver's command line, and imports
dask-otel only after the fork: it must not take itself for the forkserver, which exports
nothing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import otel_env

CLIENT = textwrap.dedent(
    """
    import logging
    import sys

    import dask
    from distributed import Client, LocalCluster

    import dask_otel


    def inc(x):
        logging.getLogger("user.task").warning("marker-from-task %d", x)
        return x + 1


    if __name__ == "__main__":
        dask_otel.instrument()
        method = {"distributed.worker.multiprocessing-method": sys.argv[1]}
        with (
            dask.config.set(method),
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address="127.0.0.1:0",
            ) as cluster,
            Client(cluster) as client,
        ):
            print(client.gather(client.map(inc, range(10))))
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_worker_processes_export_with_every_start_method(receiver, tmp_path, method):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    options = {"capture_output": True, "text": True, "timeout": 150, "cwd": tmp_path}
    out = subprocess.run([sys.executable, str(script), method], env=otel_env(receiver), **options)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[0] == str(list(range(1, 11)))
    tasks = receiver.wait_for(lambda r: len(spans := r.spans(name="task inc")) == 10 and spans)
    assert {s["resource"]["service.name"] for s in tasks} == {"dask-worker"}

    def markers(r):
        return [
            record
            for record in r.log_records()
            if "marker-from-task" in str(record["body"])
            and record["resource"]["service.name"] == "dask-worker"
        ]

    assert len(receiver.wait_for(lambda r: len(found := markers(r)) == 10 and found)) == 10
    points = receiver.wait_for(lambda r: r.metrics(name="dask.worker.memory"))
    assert {p["resource"]["service.name"] for p in points} == {"dask-worker"}
