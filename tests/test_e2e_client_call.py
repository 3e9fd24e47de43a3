"""One call in client code: `dask_otel.instrument(client)` reaches a cluster started
without dask-otel (LocalCluster worker processes), restarted workers included."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import HERE, otel_env
from traces import check_workload_telemetry, services


def test_instrument_client_with_local_cluster_processes(receiver, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "scripts" / "workload.py"),
            "local",
            "--instrument",
            "--restart",
        ],
        env=otel_env(receiver),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    observed = json.loads(out.stdout.strip().splitlines()[-1])
    # The scheduler lives in the client's process, which was named when it was instrumented.
    check_workload_telemetry(receiver, observed, roles={"dask-client", "dask-worker"})

    # Workers restarted by the Nanny get the plugin again from the scheduler.
    restarted = receiver.wait_for(
        lambda r: len(spans := r.spans(name="task after_restart")) == 2 and spans
    )
    before = {i for n, i in services(receiver.spans(name="task slow_inc"))}
    after = {i for n, i in services(restarted)}
    assert len(after) == 2 and not after & before
