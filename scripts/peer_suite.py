#!/usr/bin/env python3
"""Run a slice of distributed's own test suite plain and with dask-otel active, compare.

dask-otel must not turn a passing ``distributed`` test into a failing one. This script
runs chosen test files of distributed's suite twice in a virtualenv that has this
checkout installed:

* **plain**: ``python -m pytest ...`` with every ``OTEL_*`` variable removed;
* **instrumented**: ``opentelemetry-instrument python -m pytest ...``, so the pytest
  process is instrumented before the first test, and every process it starts (a Nanny's
  worker, a ``LocalCluster`` process) inherits the instrumentation through the
  environment (``opentelemetry-instrument``'s ``sitecustomize`` on ``PYTHONPATH``). All
  three signals are exported over OTLP/gRPC to a counting receiver this script starts on
  127.0.0.1, so spans, metrics and log records are really created and sent; what it
  received is printed as evidence, together with a probe (a pytest plugin loaded in both
  runs) that reports whether dask-otel's hooks were installed in the pytest process.

Both runs use distributed's own pytest configuration and ``conftest.py`` (from the sdist
of the tested release on PyPI: ``-W error`` style ``filterwarnings``, strict markers),
``-p no:cacheprovider``, a per-test timeout (``signal`` method, so one hang costs one
test, not the run), no xdist, and write junit XML. The outcomes are compared per test
id; every test that passed plain but failed or errored instrumented is re-run on its own,
``--reruns`` times in each mode, to tell flaky tests from regressions:

* ``confirmed``: failed instrumented in at least two reruns and never plain: a regression;
* ``intermittent``: failed instrumented in one rerun only, never plain;
* ``flaky``: also fails plain, or did not fail again instrumented.

The exit code is 1 if any regression is confirmed, 2 for a setup problem, else 0.

distributed's wheels and sdists do not ship ``distributed/tests``: the test files come
from ``--tests-from`` (a source tree, or a ``.tar.gz``/``.tar.xz`` archive, path or URL),
by default GitHub's archive of the release tag. Test files from another release than
the installed one work too (tests that do not fit the installed release fail in both runs
alike and are left out of the comparison), but say so in what you report.

Examples::

    python scripts/peer_suite.py --distributed 2026.8.0 --files test_spill.py
    python scripts/peer_suite.py --distributed 2025.9.0 --reuse-venv \\
        --files test_worker.py test_scheduler.py --tests-from ~/src/distributed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GITHUB_ARCHIVE = "https://github.com/dask/distributed/archive/refs/tags/{version}.tar.gz"
TEST_PACKAGE = "distributed_tests"  # not "distributed": the installed package must win
TEST_DEPENDENCIES = ["pytest", "pytest-timeout", "pytest-rerunfailures", "numpy"]
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")

# --------------------------------------------------------------------------------------
# The counting OTLP receiver (runs in the virtualenv: ``--receiver PORTFILE COUNTSFILE``)


def run_receiver(port_file: Path, counts_file: Path) -> None:
    """Count what OTLP/gRPC exporters send to 127.0.0.1; write the counts as JSON."""
    import threading
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
    from opentelemetry.proto.collector.metrics.v1 import (
        metrics_service_pb2,
        metrics_service_pb2_grpc,
    )
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    lock = threading.Lock()
    spans_by_service: Counter[str] = Counter()
    spans_by_name: Counter[str] = Counter()
    logs_by_service: Counter[str] = Counter()
    points_by_service: Counter[str] = Counter()
    instances: set[str] = set()
    instrumented_instances: set[str] = set()
    dirty = [False]

    def resource(rs) -> tuple[str, str]:  # type: ignore[no-untyped-def]
        attrs = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
        return attrs.get("service.name", "?"), attrs.get("service.instance.id", "?")

    def traces(request, context):  # type: ignore[no-untyped-def]
        with lock:
            for rs in request.resource_spans:
                service, instance = resource(rs)
                instances.add(instance)
                for ss in rs.scope_spans:
                    if ss.scope.name == "dask_otel" and ss.spans:
                        instrumented_instances.add(instance)
                    spans_by_service[service] += len(ss.spans)
                    for span in ss.spans:
                        spans_by_name[span.name] += 1
            dirty[0] = True
        return trace_service_pb2.ExportTraceServiceResponse()

    def metrics(request, context):  # type: ignore[no-untyped-def]
        with lock:
            for rm in request.resource_metrics:
                service, instance = resource(rm)
                instances.add(instance)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        points = getattr(metric, kind).data_points if kind else ()
                        points_by_service[service] += len(points)
            dirty[0] = True
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def logs(request, context):  # type: ignore[no-untyped-def]
        with lock:
            for rl in request.resource_logs:
                service, instance = resource(rl)
                instances.add(instance)
                for sl in rl.scope_logs:
                    logs_by_service[service] += len(sl.log_records)
            dirty[0] = True
        return logs_service_pb2.ExportLogsServiceResponse()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        Export = staticmethod(traces)

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        Export = staticmethod(metrics)

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        Export = staticmethod(logs)

    def write() -> None:
        with lock:
            data = {
                "spans": sum(spans_by_service.values()),
                "spans_by_service": dict(spans_by_service),
                "top_span_names": dict(spans_by_name.most_common(12)),
                "log_records": sum(logs_by_service.values()),
                "log_records_by_service": dict(logs_by_service),
                "metric_points": sum(points_by_service.values()),
                "metric_points_by_service": dict(points_by_service),
                "processes": len(instances),
                "processes_with_dask_otel_spans": len(instrumented_instances),
            }
            dirty[0] = False
        tmp = counts_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(counts_file)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    write()
    port_file.write_text(str(port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(2):
        if dirty[0]:
            write()
    server.stop(grace=2).wait()
    write()


# --------------------------------------------------------------------------------------
# The probe plugin, loaded with ``-p peer_suite_probe`` in both runs

PROBE = '''
"""Reports whether dask-otel was active in this pytest process (written by peer_suite)."""
import json
import os
import sys


def _state():
    state = {"dask_otel_imported": "dask_otel" in sys.modules}
    if state["dask_otel_imported"]:
        import distributed
        from dask_otel import DaskInstrumentor

        state["instrumentor_active"] = bool(
            DaskInstrumentor().is_instrumented_by_opentelemetry
        )
        state["hooks_installed"] = {
            name: hasattr(getattr(distributed, name).__init__, "__wrapped__")
            for name in ("Scheduler", "Worker", "Nanny")
        }
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        state["tracer_provider"] = type(trace.get_tracer_provider()).__name__
    state["otel_env"] = sorted(k for k in os.environ if k.startswith("OTEL_"))
    return state


def pytest_sessionstart(session):
    session.config._peer_suite_start = _state()


def pytest_sessionfinish(session):
    path = os.environ.get("PEER_SUITE_PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump({"start": session.config._peer_suite_start, "end": _state()}, f)
'''

# --------------------------------------------------------------------------------------
# Preparing the virtualenv and the tests


def log(message: str) -> None:
    print(f"[peer_suite {time.strftime('%H:%M:%S')}] {message}", flush=True)


def pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args]
    subprocess.run(cmd, check=True)


def prepare_venv(args: argparse.Namespace, version: str, workdir: Path) -> Path:
    venv = Path(args.venv) if args.venv else workdir / f"venv-{version}"
    python = venv / "bin" / "python"
    if python.exists() and args.reuse_venv:
        log(f"reusing {venv}; reinstalling this checkout into it")
        pip(venv, "install", "-q", "--no-deps", "--force-reinstall", str(REPO))
    else:
        if venv.exists():
            shutil.rmtree(venv)
        log(f"creating {venv} (distributed=={version})")
        subprocess.run([args.python, "-m", "venv", str(venv)], check=True)
        constraints = REPO / ".ci" / "constraints.txt"
        pins = ["-c", str(constraints)] if constraints.exists() else []
        pip(
            venv,
            "install",
            "-q",
            *pins,
            str(REPO),
            f"distributed=={version}",
            f"dask=={version}",
            *TEST_DEPENDENCIES,
            *args.extra,
        )
    out = subprocess.run(
        [str(python), "-c", "import distributed; print(distributed.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if out != version:
        sys.exit(f"{venv} has distributed {out}, not {version}; drop --reuse-venv")
    return venv


def download(url: str, dest: Path) -> Path:
    if not dest.exists():
        log(f"downloading {url}")
        tmp = dest.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=120) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
        tmp.replace(dest)
    return dest


def extract(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` into ``dest`` once; the directory that holds ``distributed/``."""
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tar.extractall(tmp)
        tmp.replace(dest)
    for candidate in (dest, *sorted(p for p in dest.iterdir() if p.is_dir())):
        if (candidate / "distributed").is_dir():
            return candidate
    sys.exit(f"no distributed/ directory in {archive}")


def tests_source(args: argparse.Namespace, version: str, workdir: Path) -> Path:
    """A directory with ``distributed/tests`` for ``version`` (or what the user gave)."""
    source = args.tests_from or GITHUB_ARCHIVE.format(version=version)
    if source.startswith(("http://", "https://")):
        name = source.rstrip("/").rsplit("/", 1)[-1]
        try:
            archive = download(source, workdir / "downloads" / f"tests-{name}")
        except OSError as e:
            sys.exit(
                f"cannot download distributed's tests from {source}: {e}\n"
                "Pass --tests-from with a dask/distributed source tree or archive."
            )
        root = extract(archive, workdir / "sources" / f"tests-{name}")
    elif Path(source).is_dir():
        root = Path(source)
    else:
        path = Path(source)
        root = extract(path, workdir / "sources" / f"tests-{path.name}")
    if not (root / "distributed" / "tests").is_dir():
        sys.exit(f"{root} has no distributed/tests directory")
    return root


def release_config(venv: Path, version: str, workdir: Path) -> Path:
    """The sdist of ``version``: its pyproject.toml (pytest config) and conftest.py."""
    dest = workdir / "sources" / f"sdist-distributed-{version}"
    downloads = workdir / "downloads"
    name = f"distributed-{version}.tar.gz"
    if not dest.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        if not (downloads / name).exists():
            log(f"fetching the sdist of distributed {version} for its pytest config")
            pip(
                venv,
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(downloads),
                f"distributed=={version}",
            )
    return extract(downloads / name, dest)  # unpacks only the first time


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[\n" + "".join(f"  {_toml(v)},\n" for v in value) + "]"
    raise TypeError(value)


def pytest_options(pyproject: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    data = tomllib.loads(pyproject.read_text())
    return dict(data.get("tool", {}).get("pytest", {}).get("ini_options", {}))


def build_rundir(
    venv: Path, config_root: Path, tests_root: Path, files: list[str], rundir: Path
) -> None:
    """distributed's tests as package ``distributed_tests``, its config and conftest."""
    if rundir.exists():
        shutil.rmtree(rundir)
    shutil.copytree(tests_root / "distributed" / "tests", rundir / TEST_PACKAGE)
    for name in files:
        if not (rundir / TEST_PACKAGE / name).exists():
            sys.exit(f"{name} is not in {tests_root / 'distributed' / 'tests'}")
    conftest = config_root / "conftest.py"
    if not conftest.exists():
        conftest = tests_root / "conftest.py"
    shutil.copy(conftest, rundir / "conftest.py")
    (rundir / "probe").mkdir()
    (rundir / "probe" / "peer_suite_probe.py").write_text(PROBE)
    # Some wheels (2025.9.0) lack the conftest's plugin distributed.pytest_resourceleaks:
    # use the copy from the tests' source tree, under another name.
    check = "import importlib.util as u; print(u.find_spec('distributed.pytest_resourceleaks'))"
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True
    ).stdout.strip()
    # distributed.utils_test.get_cert reads TLS certificates from the installed package's
    # tests/ directory, which wheels lack (test_scheduler.py uses them at import time).
    where = "import distributed, os; print(os.path.dirname(distributed.__file__))"
    package = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True
        ).stdout.strip()
    )
    certs = sorted((tests_root / "distributed" / "tests").glob("*.pem"))
    if certs and not (package / "tests" / certs[0].name).exists():
        (package / "tests").mkdir(exist_ok=True)
        for cert in certs:
            shutil.copy(cert, package / "tests" / cert.name)
        log(f"copied {len(certs)} TLS test certificates into {package / 'tests'}")
    if found == "None":
        plugin = tests_root / "distributed" / "pytest_resourceleaks.py"
        shutil.copy(plugin, rundir / "probe" / "distributed_pytest_resourceleaks.py")
        text = (rundir / "conftest.py").read_text()
        text = text.replace(
            '"distributed.pytest_resourceleaks"', '"distributed_pytest_resourceleaks"'
        )
        (rundir / "conftest.py").write_text(text)
        log(f"the installed distributed has no pytest_resourceleaks: using {plugin}")
    options = pytest_options(config_root / "pyproject.toml")
    # Markers the test files use but the release's config no longer registers
    # (--strict-markers would make them collection errors).
    markers = list(options.get("markers", []))
    known = {m.split(":")[0].strip() for m in markers}
    if (tests_root / "pyproject.toml").exists():
        for m in pytest_options(tests_root / "pyproject.toml").get("markers", []):
            if m.split(":")[0].strip() not in known:
                markers.append(m)
    options["markers"] = markers
    # Coverage options (2025.9.0 has --cov-config) would need pytest-cov: not measured here.
    if isinstance(options.get("addopts"), str):
        options["addopts"] = " ".join(
            opt for opt in options["addopts"].split() if not opt.startswith("--cov")
        )
    options["testpaths"] = [TEST_PACKAGE]
    lines = ["[tool.pytest.ini_options]"]
    lines += [f"{key} = {_toml(value)}" for key, value in options.items()]
    (rundir / "pyproject.toml").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------
# Running pytest


class Receiver:
    def __init__(self, venv: Path, directory: Path) -> None:
        self.port_file = directory / "receiver.port"
        self.counts_file = directory / "receiver.json"
        self.port_file.unlink(missing_ok=True)
        cmd = [
            str(venv / "bin" / "python"),
            str(Path(__file__).resolve()),
            "--receiver",
            str(self.port_file),
            str(self.counts_file),
        ]
        self.process = subprocess.Popen(cmd, env=clean_env())
        deadline = time.monotonic() + 60
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                sys.exit("the OTLP receiver did not start")
            time.sleep(0.1)
        self.port = int(self.port_file.read_text())

    def stop(self) -> dict:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return json.loads(self.counts_file.read_text())


def clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "DASK_OTEL_", "DASK_", "PYTEST_"))
        and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }


def mode_env(mode: str, rundir: Path, port: int | None) -> dict[str, str]:
    env = clean_env()
    env["PYTHONPATH"] = str(rundir / "probe")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if mode == "instrumented":
        assert port is not None
        env.update(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_LOGS_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_METRIC_EXPORT_INTERVAL="5000",
            OTEL_BSP_SCHEDULE_DELAY="1000",
        )
    return env


def pytest_command(venv: Path, mode: str, args: argparse.Namespace, junit: Path) -> list[str]:
    bindir = venv / "bin"
    cmd = [str(bindir / "python"), "-m", "pytest"]
    if mode == "instrumented":
        cmd = [str(bindir / "opentelemetry-instrument"), *cmd]
    return [
        *cmd,
        "-p",
        "no:cacheprovider",
        "-p",
        "peer_suite_probe",
        "--timeout",
        str(args.timeout),
        "-o",
        "timeout_method=signal",
        "--color=no",
        f"--junitxml={junit}",
        *args.pytest_args,
    ]


def run_pytest(
    venv: Path,
    mode: str,
    args: argparse.Namespace,
    rundir: Path,
    targets: list[str],
    out: Path,
    quiet: bool = False,
) -> tuple[float, dict | None, dict | None]:
    """Run pytest on ``targets`` in ``mode``; wall time, probe report, receiver counts."""
    receiver = Receiver(venv, out.parent) if mode == "instrumented" else None
    env = mode_env(mode, rundir, receiver.port if receiver else None)
    env["PEER_SUITE_PROBE_OUT"] = str(out.with_suffix(".probe.json"))
    cmd = pytest_command(venv, mode, args, out.with_suffix(".xml")) + targets
    if not quiet:
        log(f"{mode}: {' '.join(cmd)}  (output: {out.with_suffix('.log')})")
    start = time.monotonic()
    try:
        with open(out.with_suffix(".log"), "w") as logfile:
            subprocess.run(cmd, cwd=rundir, env=env, stdout=logfile, stderr=subprocess.STDOUT)
    finally:
        counts = receiver.stop() if receiver else None
    wall = time.monotonic() - start
    probe_file = out.with_suffix(".probe.json")
    probe = json.loads(probe_file.read_text()) if probe_file.exists() else None
    return wall, probe, counts


# --------------------------------------------------------------------------------------
# junit XML


def read_junit(path: Path) -> dict[str, dict]:
    """test id -> {"outcome": ..., "message": ...}, the worst outcome of each test."""
    if not path.exists():
        return {}
    rank = {o: i for i, o in enumerate(("passed", "skipped", "xfailed", "failed", "error"))}
    results: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
            if child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome = "xfailed" if xfail else "skipped"
                message = child.get("message") or ""
        previous = results.get(test_id)
        if previous is None or rank[outcome] > rank[previous["outcome"]]:
            results[test_id] = {"outcome": outcome, "message": message.strip()}
    return results


def node_id(test_id: str, rundir: Path) -> str:
    """Junit id ``pkg.test_x.TestC::test_y[p]`` -> node id ``pkg/test_x.py::TestC::test_y[p]``."""
    classname, name = test_id.split("::", 1)
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = Path(*parts[:i]).with_suffix(".py")
        if (rundir / path).exists():
            return "::".join([path.as_posix(), *parts[i:], name])
    return test_id


def counts_line(results: dict[str, dict]) -> str:
    c = Counter(r["outcome"] for r in results.values())
    return " ".join(f"{o}={c.get(o, 0)}" for o in OUTCOMES) + f" total={len(results)}"


# --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--distributed",
        metavar="VERSION",
        help="distributed release to test against (default: the one installed with "
        "the Python running this script)",
    )
    parser.add_argument(
        "--files",
        nargs="+",
        default=["test_spill.py"],
        metavar="FILE",
        help="test files of distributed/tests to run (default: test_spill.py)",
    )
    parser.add_argument(
        "--tests-from",
        metavar="PATH_OR_URL",
        help="where distributed's tests come from: a source tree, or a .tar.gz/.tar.xz "
        "archive path or URL (default: GitHub's archive of the release tag)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dask-otel-peer-suite",
        help="virtualenvs, downloads and results go here (default: %(default)s)",
    )
    parser.add_argument("--venv", help="virtualenv path (default: WORKDIR/venv-VERSION)")
    parser.add_argument(
        "--reuse-venv",
        action="store_true",
        help="reuse an existing virtualenv (this checkout is still reinstalled into it)",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for a new virtualenv")
    parser.add_argument(
        "--extra", nargs="*", default=[], metavar="PKG", help="more packages to install"
    )
    parser.add_argument(
        "--timeout", type=int, default=300, help="per-test timeout, s (default: 300)"
    )
    parser.add_argument(
        "--reruns",
        type=int,
        default=3,
        help="runs of each suspect test per mode when re-checking (default: 3)",
    )
    parser.add_argument(
        "--pytest-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="everything after this goes to pytest (e.g. -k expr, --runslow)",
    )
    parser.add_argument("--receiver", nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_evidence(probe: dict | None, counts: dict | None) -> bool:
    """Print what shows dask-otel was active; True if its hooks were installed."""
    start = (probe or {}).get("start", {})
    end = (probe or {}).get("end", {})
    print("  probe in the pytest process, at session start:", json.dumps(start))
    print("  receiver (OTLP/gRPC on 127.0.0.1):", json.dumps(counts))
    hooks = end.get("hooks_installed", {})
    active = bool(start.get("instrumentor_active") and hooks and all(hooks.values()))
    if active and not (counts or {}).get("spans"):
        print("  (no spans received: these tests start no scheduler, worker or client)")
    return active


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.receiver:
        run_receiver(Path(args.receiver[0]), Path(args.receiver[1]))
        return 0
    version = args.distributed
    if version is None:
        try:
            version = importlib.metadata.version("distributed")
        except importlib.metadata.PackageNotFoundError:
            print("distributed is not installed here: pass --distributed VERSION")
            return 2
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    venv = prepare_venv(args, version, workdir)
    tests_root = tests_source(args, version, workdir)
    config_root = release_config(venv, version, workdir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = workdir / f"results-{version}-{stamp}"
    rundir = results_dir / "run"
    results_dir.mkdir(parents=True)
    build_rundir(venv, config_root, tests_root, args.files, rundir)
    head = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    log(
        f"distributed {version}; tests from {tests_root}; pytest config and conftest "
        f"from {config_root}; dask-otel {head}; results in {results_dir}"
    )
    targets = [f"{TEST_PACKAGE}/{name}" for name in args.files]

    runs: dict[str, dict] = {}
    walls: dict[str, float] = {}
    evidence = {}
    for mode in ("plain", "instrumented"):
        wall, probe, counts = run_pytest(venv, mode, args, rundir, targets, results_dir / mode)
        runs[mode] = read_junit(results_dir / f"{mode}.xml")
        walls[mode] = wall
        evidence[mode] = (probe, counts)
        log(f"{mode}: {counts_line(runs[mode])} wall={wall:.0f}s")
        if not runs[mode]:
            log(f"{mode}: no junit results; see {results_dir / mode}.log")
            return 2

    print(f"\n== distributed {version}: {' '.join(args.files)}")
    for mode in runs:
        print(f"  {mode:>12}: {counts_line(runs[mode])}  wall {walls[mode]:.0f}s")
    print("\n== evidence that dask-otel was active in the instrumented run")
    active = print_evidence(*evidence["instrumented"])
    plain_probe = (evidence["plain"][0] or {}).get("end", {})
    print("  probe in the plain run:", json.dumps(plain_probe))
    if not active:
        print("  !! instrumentation was NOT shown active: the comparison proves nothing")
    plain, inst = runs["plain"], runs["instrumented"]
    bad = {"failed", "error"}
    regressions = sorted(
        t
        for t in plain
        if plain[t]["outcome"] == "passed" and inst.get(t, {}).get("outcome") in bad
    )
    fixed = sorted(
        t
        for t in plain
        if plain[t]["outcome"] in bad and inst.get(t, {}).get("outcome") == "passed"
    )
    missing = sorted(set(plain) ^ set(inst))
    changed = sorted(
        t
        for t in plain
        if plain[t]["outcome"] in bad
        and inst.get(t, {}).get("outcome") in bad
        and plain[t]["message"].split("\n", 1)[0] != inst[t]["message"].split("\n", 1)[0]
    )
    print(f"\n== passed plain, failed instrumented: {len(regressions)}")
    for t in regressions:
        message = inst[t]["message"]
        print(f"  {t} [{inst[t]['outcome']}]")
        print("    " + "\n    ".join(message.splitlines()[-25:]))
    print(f"== failed plain, passed instrumented (flakiness indicator): {len(fixed)}")
    for t in fixed:
        print(f"  {t}")
    print(f"== failed in both runs, with another first line instrumented: {len(changed)}")
    for t in changed:
        print(f"  {t}\n    plain: {plain[t]['message'].split(chr(10), 1)[0][:300]}")
        print(f"    instrumented: {inst[t]['message'].split(chr(10), 1)[0][:300]}")
    if missing:
        print(f"== in one run only: {len(missing)}: {', '.join(missing[:20])}")

    verdicts: dict[str, dict] = {}
    if regressions:
        print(f"\n== re-running {len(regressions)} test(s) alone, {args.reruns}x per mode")
        for t in regressions:
            nid = node_id(t, rundir)
            fails = {"plain": 0, "instrumented": 0}
            for i in range(args.reruns):
                for mode in ("plain", "instrumented"):
                    out = results_dir / "reruns" / f"{len(verdicts)}-{mode}-{i}"
                    out.parent.mkdir(exist_ok=True)
                    run_pytest(venv, mode, args, rundir, [nid], out, quiet=True)
                    outcome = read_junit(out.with_suffix(".xml")).get(t, {}).get("outcome")
                    fails[mode] += outcome != "passed"
            if fails["plain"] == 0 and fails["instrumented"] >= 2:
                verdict = "confirmed"
            elif fails["plain"] == 0 and fails["instrumented"] == 1:
                verdict = "intermittent"
            else:
                verdict = "flaky"
            verdicts[t] = {"verdict": verdict, **fails}
            print(
                f"  {verdict:>12}: {nid}  (failed plain {fails['plain']}/{args.reruns}, "
                f"instrumented {fails['instrumented']}/{args.reruns})"
            )
    summary = {
        "distributed": version,
        "dask_otel": head,
        "files": args.files,
        "tests_from": str(tests_root),
        "counts": {m: Counter(r["outcome"] for r in runs[m].values()) for m in runs},
        "wall_seconds": walls,
        "evidence": {m: {"probe": p, "receiver": c} for m, (p, c) in evidence.items()},
        "passed_plain_failed_instrumented": {
            t: {**inst[t], **verdicts.get(t, {})} for t in regressions
        },
        "failed_plain_passed_instrumented": fixed,
        "failed_both_other_message": changed,
    }
    (results_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nsummary: {results_dir / 'summary.json'}")
    confirmed = [t for t, v in verdicts.items() if v["verdict"] == "confirmed"]
    if not active:
        return 2
    return 1 if confirmed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
