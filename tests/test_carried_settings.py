"""``dask_otel.instrument(client)`` against a cluster started on its own: the client's
settings of what leaves the cluster reach the plugins it registers, in the processes
running now and in a worker that joins later; where a process's own setting is the
stricter one, it stays, and the client says so once."""

from __future__ import annotations

import json

import dask
import pytest
from conftest import otel_env, start_scheduler, start_worker
from distributed import Client

import dask_otel
import dask_otel.config  # dask-otel's defaults in Dask's config, before any test
from dask_otel.plugins import carried

SECRET = "hunter2-in-the-message"


def test_the_stricter_of_two_settings_wins():
    own = {"otel.max-attribute-length": 64, "otel.redact.exception-messages": False}
    with dask.config.set(own):  # restored after, whatever apply_asked set
        kept = carried.apply_asked(
            {"otel.max-attribute-length": 1000, "otel.redact.exception-messages": True}
        )
        assert kept == ["otel.max-attribute-length: 64"]
        assert dask.config.get("otel.redact.exception-messages") is True
        assert dask.config.get("otel.max-attribute-length") == 64


def test_only_what_the_client_changed_is_carried():
    assert carried.asked() == {}
    with dask.config.set({"otel.redact.log-bodies": True, "otel.task.sample-ratio": 0.5}):
        assert carried.asked() == {"otel.redact.log-bodies": True, "otel.task.sample-ratio": 0.5}


@pytest.mark.timeout(240)
def test_redaction_asked_by_the_client_reaches_a_cluster_started_on_its_own(
    receiver, processes, telemetry, capsys
):
    def leak(x: int) -> int:  # local: pickled by value for workers that cannot import tests
        raise ValueError(f"{SECRET} {x}")

    # Plain `dask scheduler` and `dask worker`, dask-otel installed, no otel.* settings
    # but the scheduler's length cap; they export to the receiver once instrumented.
    env = otel_env(receiver)
    address = start_scheduler(
        processes, {**env, "DASK_OTEL__MAX_ATTRIBUTE_LENGTH": "64"}, instrumented=False
    )
    start_worker(processes, env, address, "w1", instrumented=False)
    asked = {"otel.redact.exception-messages": True, "otel.max-attribute-length": 1000}
    with dask.config.set(asked), Client(address, timeout=60) as client:
        client.wait_for_workers(1, timeout=60)
        dask_otel.instrument(client)
        start_worker(processes, env, address, "w2", instrumented=False)  # joins later
        client.wait_for_workers(2, timeout=60)
        workers = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        for name in ("w1", "w2"):
            future = client.submit(leak, 1, key=f"leak-{name}", workers=[workers[name]])
            with pytest.raises(ValueError, match=SECRET):  # Dask's own error is untouched
                future.result(timeout=60)
        said = capsys.readouterr().err
        receiver.wait_for(lambda rx: len(rx.spans("task leak")) == 2, timeout=60)
        receiver.wait_for(
            lambda rx: [r for r in rx.log_records() if "leak-w2" in json.dumps(r, default=str)]
        )
    assert said.count("the scheduler keeps its own otel.max-attribute-length: 64") == 1
    spans, records, _ = receiver.drain()
    for span in spans:
        assert SECRET not in json.dumps(span, default=str), span
    for record in records:
        assert SECRET not in json.dumps(record, default=str), record
    redacted = [s for s in spans if s["name"] == "task leak"]
    assert all("[redacted]" in json.dumps(s) for s in redacted)
