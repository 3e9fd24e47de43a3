"""dask_otel.distro.sdk: roles from command lines, and the SDK as dask-otel configures it.

Configuring the SDK sets process-wide globals, so every configuration test runs in a
fresh interpreter. Exporters are ``none`` unless a test is about the exporter defaults;
those point OTLP at a closed port on 127.0.0.1 and leave with ``os._exit`` before any
export is attempted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import otel_env

from dask_otel.distro.sdk import ENV_DEFAULTS, infer_role

# -- infer_role -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "role"),
    [
        (["/x/dask-scheduler"], "scheduler"),
        (["/x/dask-scheduler", "--port", "8786", "--no-dashboard"], "scheduler"),
        (["dask-scheduler"], "scheduler"),
        (["/x/dask", "scheduler"], "scheduler"),
        (["/x/dask", "scheduler", "--host", "127.0.0.1"], "scheduler"),
        (["/x/dask-worker", "tcp://127.0.0.1:8786"], "nanny"),
        (["/x/dask-worker", "tcp://127.0.0.1:8786", "--nthreads", "1"], "nanny"),
        (["/x/dask-worker", "tcp://127.0.0.1:8786", "--no-nanny"], "worker"),
        (["/x/dask-worker", "--no-nanny", "--scheduler-file", "s.json"], "worker"),
        (["/x/dask", "worker", "tcp://127.0.0.1:8786"], "nanny"),
        (["/x/dask", "worker", "tcp://127.0.0.1:8786", "--no-nanny"], "worker"),
        (["/x/dask", "worker", "--nanny", "tcp://127.0.0.1:8786"], "nanny"),
        # Not a Dask role.
        (["/x/python", "script.py"], None),
        (["script.py", "--scheduler"], None),
        (["/x/client.py", "dask-scheduler"], None),
        (["-c"], None),
        (["/x/dask"], None),
        (["/x/dask", "info"], None),
        (["/x/dask", "--version"], None),
        ([], None),
        ([""], None),
    ],
)
def test_infer_role(argv, role):
    assert infer_role(argv) == role


def test_infer_role_does_not_touch_argv():
    argv = ["/x/dask", "worker", "tcp://127.0.0.1:8786", "--no-nanny"]
    infer_role(argv)
    assert argv == ["/x/dask", "worker", "tcp://127.0.0.1:8786", "--no-nanny"]


# -- configure, in fresh processes ----------------------------------------------------------

PRELUDE = """
import json, os, sys
from opentelemetry import _logs, metrics, trace
from dask_otel.distro import sdk


def resources():
    tp = trace.get_tracer_provider()
    mp = metrics.get_meter_provider()
    lp = _logs.get_logger_provider()
    out = {"types": [type(tp).__name__, type(mp).__name__, type(lp).__name__]}
    if hasattr(tp, "resource"):
        out["tracer"] = dict(tp.resource.attributes)
    if hasattr(mp, "_sdk_config"):
        out["meter"] = dict(mp._sdk_config.resource.attributes)
    if hasattr(lp, "resource"):
        out["logger"] = dict(lp.resource.attributes)
    return out
"""


def run(code: str, **env: str) -> dict:
    """Run ``code`` (after PRELUDE) in a fresh interpreter; it prints one JSON object."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    clean.update(
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
    )
    clean.update(env)
    for name in [k for k, v in clean.items() if v is None]:
        del clean[name]
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_configure_scheduler():
    result = run(
        """
        sdk.configure("scheduler")
        print(json.dumps(resources()))
        """
    )
    assert result["types"] == ["TracerProvider", "MeterProvider", "LoggerProvider"]
    for signal in ("tracer", "meter", "logger"):
        assert result[signal]["service.name"] == "dask-scheduler"
        assert result[signal]["service.instance.id"]
        assert result[signal]["telemetry.sdk.language"] == "python"
    # One process, one instance id on all three signals.
    assert len({result[s]["service.instance.id"] for s in ("tracer", "meter", "logger")}) == 1


@pytest.mark.parametrize(
    "env",
    [{"OTEL_SERVICE_NAME": "mine"}, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=mine,team=x"}],
)
def test_users_service_name_wins(env):
    result = run(
        """
        sdk.configure("scheduler")
        print(json.dumps(resources()))
        """,
        **env,
    )
    for signal in ("tracer", "meter", "logger"):
        assert result[signal]["service.name"] == "mine"
    if "OTEL_RESOURCE_ATTRIBUTES" in env:
        assert result["tracer"]["team"] == "x"


def test_users_service_name_wins_over_a_late_role():
    result = run(
        """
        sdk.DaskOtelConfigurator().configure()
        sdk.configure("worker")
        print(json.dumps(resources()))
        """,
        OTEL_SERVICE_NAME="mine",
    )
    for signal in ("tracer", "meter", "logger"):
        assert result[signal]["service.name"] == "mine"


def test_sdk_disabled_leaves_the_proxy_provider():
    result = run(
        """
        sdk.configure("scheduler")
        from dask_otel import runtime as telemetry
        result = resources()
        result["configured"] = telemetry.is_configured()
        result["defaults"] = "OTEL_BSP_MAX_QUEUE_SIZE" in os.environ
        print(json.dumps(result))
        """,
        OTEL_SDK_DISABLED="true",
    )
    assert result["types"][0] == "ProxyTracerProvider"
    assert "tracer" not in result
    assert result["configured"] is False
    assert result["defaults"] is False


def test_a_users_provider_is_left_alone():
    result = run(
        """
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        mine = TracerProvider(resource=Resource({"service.name": "users-app"}))
        trace.set_tracer_provider(mine)
        sdk.configure("scheduler")
        sdk.configure("worker")
        sdk.DaskOtelConfigurator().configure()  # as opentelemetry-instrument would
        result = resources()
        result["same"] = trace.get_tracer_provider() is mine
        result["owned"] = sdk.owns_providers()
        queues = [k for k in sdk.ENV_DEFAULTS if k.startswith(("OTEL_BSP", "OTEL_BLRP"))]
        result["defaults"] = [k for k in queues if k in os.environ]
        print(json.dumps(result))
        """
    )
    assert result["same"] is True
    assert result["tracer"]["service.name"] == "users-app"
    # dask-otel configured nothing: no meter or logger provider, no env defaults.
    assert result["types"][1:] == ["_ProxyMeterProvider", "ProxyLoggerProvider"]
    assert result["owned"] is False
    assert result["defaults"] == []


def test_unknown_role_then_named_on_all_three_providers():
    result = run(
        """
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        sys.argv = ["-c", "--multiprocessing-fork"]  # a Nanny's spawned child
        sdk.DaskOtelConfigurator().configure()  # no role yet
        exporter = InMemorySpanExporter()
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
        tracer = trace.get_tracer("early")  # obtained before the role is known
        before = resources()
        sdk.configure("worker")
        after = resources()
        sdk.configure("scheduler")  # named already: a later role changes nothing
        again = resources()
        tracer.start_span("s").end()
        (span,) = exporter.get_finished_spans()
        print(json.dumps({
            "before": before, "after": after, "again": again,
            "span": dict(span.resource.attributes),
        }))
        """
    )
    before, after, again = result["before"], result["after"], result["again"]
    for signal in ("tracer", "meter", "logger"):
        assert before[signal]["service.name"].startswith("unknown_service")
        assert after[signal]["service.name"] == "dask-worker"
        assert again[signal]["service.name"] == "dask-worker"
        assert after[signal]["service.instance.id"] == before[signal]["service.instance.id"]
    # Tracers handed out before the rename report the new name too.
    assert result["span"]["service.name"] == "dask-worker"


def test_a_users_script_is_a_client_from_its_first_signal():
    """A script's own spans, before any Dask object exists, and its computations' share
    one ``service.name``; ``host.name`` says which machine."""
    result = run(
        """
        sys.argv = ["/x/job.py"]
        sdk.DaskOtelConfigurator().configure()
        before = resources()
        sdk.configure("scheduler")  # an in-process cluster: the process keeps its name
        print(json.dumps({"before": before, "after": resources()}))
        """
    )
    for signal in ("tracer", "meter", "logger"):
        assert result["before"][signal]["service.name"] == "dask-client"
        assert result["after"][signal]["service.name"] == "dask-client"
        assert result["before"][signal]["host.name"] == socket.gethostname()


def test_host_name_set_by_the_user_wins():
    result = run(
        """
        sdk.DaskOtelConfigurator().configure()
        print(json.dumps(resources()))
        """,
        OTEL_RESOURCE_ATTRIBUTES="host.name=from-user",
    )
    assert result["tracer"]["host.name"] == "from-user"


def test_role_from_the_command_line():
    """The configurator entry point names a `dask-worker` process a nanny."""
    result = run(
        """
        sys.argv = ["/x/dask-worker", "tcp://127.0.0.1:8786"]
        sdk.DaskOtelConfigurator().configure()
        print(json.dumps(resources()))
        """
    )
    for signal in ("tracer", "meter", "logger"):
        assert result[signal]["service.name"] == "dask-nanny"


def test_forked_child_gets_its_own_instance_and_name():
    result = run(
        """
        sdk.configure("scheduler")
        parent = resources()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                before = resources()
                sdk.configure("worker")
                os.write(w, json.dumps([before, resources()]).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        child_before, child_after = json.loads(data)
        print(json.dumps({
            "parent": parent, "parent_after": resources(),
            "child_before": child_before, "child_after": child_after,
        }))
        """
    )
    parent, child_before, child_after = (
        result["parent"],
        result["child_before"],
        result["child_after"],
    )
    for signal in ("tracer", "meter", "logger"):
        assert parent[signal]["service.name"] == "dask-scheduler"
        parent_id = parent[signal]["service.instance.id"]
        child_id = child_before[signal]["service.instance.id"]
        assert child_id != parent_id
        assert child_after[signal]["service.instance.id"] == child_id
        assert child_before[signal]["service.name"] == "dask-scheduler"
        assert child_after[signal]["service.name"] == "dask-worker"
        # The parent is not affected by its child's rename.
        assert result["parent_after"][signal] == parent[signal]


def test_env_defaults_are_set_when_unset():
    result = run(
        """
        sdk.configure("scheduler")
        tp = trace.get_tracer_provider()
        (processor,) = tp._active_span_processor._span_processors
        limits = processor.export_queue.limits  # dask-otel's queue, which counts lost spans
        result = {
            "env": {k: os.environ.get(k) for k in sdk.ENV_DEFAULTS},
            "exporter": type(processor.export_queue.exporter.exporter).__module__,
            "queue": limits.max_items,
            "batch": limits.batch,
        }
        print(json.dumps(result), flush=True)
        os._exit(0)  # before any exporter tries to reach the (closed) endpoint
        """,
        OTEL_TRACES_EXPORTER=None,
        OTEL_METRICS_EXPORTER=None,
        OTEL_LOGS_EXPORTER=None,
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
    )
    assert result["env"] == ENV_DEFAULTS
    assert result["env"]["OTEL_TRACES_EXPORTER"] == "otlp"
    assert result["env"]["OTEL_BSP_MAX_QUEUE_SIZE"] == "65536"
    assert result["exporter"].startswith("opentelemetry.exporter.otlp")
    assert result["queue"] == 65536
    assert result["batch"] == 512


def test_env_defaults_do_not_override_the_user():
    result = run(
        """
        sdk.configure("scheduler")
        print(json.dumps({k: os.environ.get(k) for k in sdk.ENV_DEFAULTS}))
        """,
        OTEL_BSP_MAX_QUEUE_SIZE="100",
        OTEL_BLRP_MAX_EXPORT_BATCH_SIZE="7",
    )
    assert result["OTEL_TRACES_EXPORTER"] == "none"
    assert result["OTEL_METRICS_EXPORTER"] == "none"
    assert result["OTEL_LOGS_EXPORTER"] == "none"
    assert result["OTEL_BSP_MAX_QUEUE_SIZE"] == "100"
    assert result["OTEL_BLRP_MAX_EXPORT_BATCH_SIZE"] == "7"
    # The ones the user left unset get dask-otel's values.
    assert result["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == "512"
    assert result["OTEL_BLRP_MAX_QUEUE_SIZE"] == "16384"


# -- exit ---------------------------------------------------------------------------------

#: An emitter made before the SDK is configured, busy building a span as the process exits.
LATE_SPAN = """
import threading, time
from opentelemetry import trace
from dask_otel.distro import sdk
from dask_otel.spans.emitter import SpanEmitter

emitter = SpanEmitter("before-the-sdk")
sdk.configure("client")
started = threading.Event()

def build():
    started.set()
    time.sleep(0.5)
    trace.get_tracer("exit").start_span("built at exit").end()

emitter.submit(build)
assert started.wait(30)
"""


def test_the_exit_builds_pending_spans_before_the_sdk_shuts_down(receiver):
    """In that order whatever the order they were set up in: an emitter made before the
    SDK was configured had its drain run after the SDK's shutdown, which then dropped the
    span it built."""
    env = otel_env(receiver)
    subprocess.run([sys.executable, "-c", LATE_SPAN], env=env, check=True, timeout=60)
    assert [span["name"] for span in receiver.spans()] == ["built at exit"]


def test_dask_otel_has_one_exit_handler():
    """runtime's, which calls the steps of each stage in order."""
    code = """
import atexit
registered = []
register = atexit.register
atexit.register = lambda call, *a, **k: registered.append(call) or register(call, *a, **k)
from dask_otel.distro import sdk
from dask_otel.spans.emitter import SpanEmitter
SpanEmitter("one")
sdk.configure("client")
print(len({c for c in registered if str(getattr(c, "__module__", "")).startswith("dask_otel")}))
"""
    env = {**os.environ, **{f"OTEL_{s}_EXPORTER": "none" for s in ("TRACES", "METRICS", "LOGS")}}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["1"], out.stderr


MOVED_NAME = """
from dask_otel.export import sdk_names

# As on an SDK release that moved one of the private names the export path relies on.
sdk_names.RELIED_ON += (sdk_names.SdkName("opentelemetry.sdk.trace", "Tracer", "_moved"),)

from opentelemetry import trace
from opentelemetry.instrumentation.auto_instrumentation import initialize

initialize()  # what opentelemetry-instrument runs first
from distributed import Client, LocalCluster

from dask_otel.export import processors

processor = trace.get_tracer_provider()._active_span_processor._span_processors[0]
print("processor:", type(processor).__name__)
with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                  dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
    assert client.gather(client.map(lambda x: x + 1, range(200))) == list(range(1, 201))
print("own processor:", type(processors.span_processor(None)).__name__)
"""


def test_an_sdk_without_a_name_the_export_path_needs_gets_the_sdks_own(receiver):
    """Zero-code, with one private SDK name missing: the configurator's processor and the
    tracers are the SDK's own, every task's span still arrives, and stderr says why once."""
    env = otel_env(receiver)
    out = subprocess.run(
        [sys.executable, "-c", MOVED_NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "processor: BatchSpanProcessor" in out.stdout
    assert "own processor: BatchSpanProcessor" in out.stdout
    assert (
        out.stderr.count("this OpenTelemetry SDK lacks opentelemetry.sdk.trace.Tracer._moved") == 1
    )
    tasks = receiver.wait_for(lambda r: [s for s in r.spans() if s["name"] == "task lambda"])
    assert len(tasks) == 200
    assert {s["parent_span_id"] for s in tasks} == {
        s["span_id"] for s in receiver.spans() if s["name"].startswith("graph")
    }
