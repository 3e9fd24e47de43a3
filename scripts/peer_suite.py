#!/usr/bin/env python3
"""Run distributed's own test files plain and with dask-otel active; compare per file.

dask-otel must not turn a passing ``distributed`` test into a failing one. Run with the
Python of a virtualenv that has this checkout, ``distributed`` and the test dependencies
(pytest-timeout, pytest-rerunfailures, numpy). Each test file runs twice, in its own
pytest process each time, alternating which mode goes first:

* **plain**: ``python -m pytest FILE`` with every ``OTEL_*`` variable removed;
* **instrumented**: ``opentelemetry-instrument python -m pytest FILE``: the pytest process
  is instrumented before the first test and every Python process it starts (a Nanny's
  worker, a LocalCluster process) inherits the instrumentation through the environment.
  Traces, metrics and logs go over OTLP/gRPC to tests/otlp_receiver.py's receiver, run
  by this script on 127.0.0.1; what it received, and a probe in the pytest process
  (scripts/peer_suite_plugin.py), are kept as evidence that dask-otel was active. With
  ``--collector down`` they go to a port where nothing listens instead, with
  ``--collector hung`` to a gRPC server that takes every request and never answers: the
  results must be the same.

The tests come from a release tag of a git repository of distributed (``--source-git
DIR --tag TAG``: ``git archive`` into a temporary directory, removed at exit) or from a
source tree (``--source DIR``); wheels and sdists of distributed do not contain them.
They run as package ``distributed_tests`` (``distributed.tests.`` in them is rewritten
to it; a subpackage's, ``distributed/shuffle/tests``, as ``distributed_tests.shuffle.tests``)
so that the installed ``distributed`` is the one tested (its ``tests/`` gets the
TLS test certificates, which wheels lack), with the source's
conftest.py and pytest configuration (warnings are errors, strict markers), a per-test
timeout (``signal`` method, so a hang costs one test), ``-p no:cacheprovider``, no xdist.

Each test that passed plain but failed or errored instrumented is run again on its own,
``--reruns`` times per mode: ``confirmed`` if it failed instrumented at least twice and
never plain, ``intermittent`` if once, else ``flaky``. Per file, the outcome counts,
wall times, load averages and suspects go to ``OUT/<file>.json`` (a subpackage's file
``shuffle/tests/test_x.py`` to ``OUT/shuffle.tests.test_x.py.json``); ``--report OUT``
prints the table of every file in OUT. Exit code: 1 if a regression is confirmed, 2 if
dask-otel was not active in the instrumented run (or was in the plain one).

Examples::

    nice -n 15 /work/venvs/peers/bin/python scripts/peer_suite.py --out results/2026.8.0 \\
        --source-git /work/.mirror/dask+distributed/repo --tag 2026.7.1 \\
        --files test_worker.py test_nanny.py
    python scripts/peer_suite.py --source ~/src/distributed --all --out results/dev
    python scripts/peer_suite.py --source ~/src/distributed --out results/dev \\
        --files diagnostics/tests/test_progress.py shuffle/tests/test_graph.py  # or --subpackages
    python scripts/peer_suite.py --report results/2026.8.0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "distributed_tests"  # not "distributed": the installed package must be tested
MODES = ("plain", "instrumented")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
BAD = ("failed", "error")
#: What ``git archive`` takes from a tag: the package (its ``tests`` directories and the
#: resource-leak plugin conftest.py loads, which some wheels, 2025.9.0's, lack), the
#: conftest and pytest config.
ARCHIVED = ("distributed", "conftest.py", "pyproject.toml")
#: ``distributed.tests.`` and ``distributed.<subpackage>.tests.`` as the run names them.
TESTS_MODULE = re.compile(r"\bdistributed\.((?:\w+\.)*?)tests\.")


def log(message: str) -> None:
    print(f"[peer_suite {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------
# The tests, in a temporary run directory


@contextlib.contextmanager
def run_directory(args: argparse.Namespace) -> Iterator[Path]:
    """A temporary directory with distributed's tests as ``distributed_tests`` (those of a
    subpackage as ``distributed_tests.<subpackage>.tests``), its conftest.py and pytest
    configuration, and the plugin; removed on exit."""
    with tempfile.TemporaryDirectory(prefix="peer-suite-") as tmp:
        rundir = Path(tmp) / "run"
        if args.source_git:
            source = Path(tmp) / "source"
            source.mkdir()
            archive = subprocess.run(
                ["git", "--git-dir", args.source_git, "archive", args.tag, *ARCHIVED],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
        else:
            source = Path(args.source)
        tests = source / "distributed" / "tests"
        if not tests.is_dir():
            sys.exit(f"{source} has no distributed/tests directory")
        shutil.copytree(tests, rundir / PACKAGE)
        for sub in sorted((source / "distributed").glob("*/**/tests")):
            shutil.copytree(sub, rundir / PACKAGE / sub.relative_to(source / "distributed"))
        for directory in [rundir / PACKAGE, *(rundir / PACKAGE).glob("**/")]:
            (directory / "__init__.py").touch()  # one package: test module names clash
        for path in (rundir / PACKAGE).glob("**/*.py"):
            text = path.read_text()
            renamed = TESTS_MODULE.sub(lambda m: f"{PACKAGE}.{m[1] and m[1] + 'tests.'}", text)
            if renamed != text:
                path.write_text(renamed)
        plugins = rundir / "plugins"
        plugins.mkdir()
        shutil.copy(Path(__file__).with_name("peer_suite_plugin.py"), plugins)
        conftest = (source / "conftest.py").read_text()
        plugin = '"distributed.pytest_resourceleaks"'
        if plugin in conftest and importlib.util.find_spec(plugin.strip('"')) is None:
            shutil.copy(
                source / "distributed" / "pytest_resourceleaks.py",
                plugins / "distributed_pytest_resourceleaks.py",
            )
            conftest = conftest.replace(plugin, '"distributed_pytest_resourceleaks"')
        (rundir / "conftest.py").write_text(conftest)
        (rundir / "pyproject.toml").write_text(pytest_config(source / "pyproject.toml"))
        install_certificates(tests)
        yield rundir


def install_certificates(tests: Path) -> None:
    """The TLS test certificates, into the installed package's ``distributed/tests/``.

    ``distributed.utils_test.get_cert`` reads them there, in the pytest process and in the
    processes it starts (test_utils_test.py calls it at import, in every child that
    unpickles a function of that module); wheels do not have them.
    """
    spec = importlib.util.find_spec("distributed")
    assert spec is not None and spec.submodule_search_locations
    target = Path(spec.submodule_search_locations[0]) / "tests"
    missing = [p for p in tests.glob("*.pem") if not (target / p.name).exists()]
    if missing:
        target.mkdir(exist_ok=True)
        for path in missing:
            shutil.copy(path, target)
        log(f"copied {len(missing)} TLS test certificates into {target}")


def pytest_config(pyproject: Path) -> str:
    """The source's ``[tool.pytest.ini_options]``, without coverage options (not measured)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    options = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]
    options["addopts"] = " ".join(
        opt for opt in options.get("addopts", "").split() if not opt.startswith("--cov")
    )
    options["testpaths"] = [PACKAGE]
    return "[tool.pytest.ini_options]\n" + "".join(
        f"{key} = {json.dumps(value)}\n" for key, value in options.items()
    )  # JSON strings, numbers and lists of strings are valid TOML


def test_files(rundir: Path, subpackages: bool = False) -> list[str]:
    """Test files of ``distributed/tests`` by name, or of the subpackages' ``tests``
    directories by path under ``distributed/`` (``diagnostics/tests/test_progress.py``)."""
    pattern = "*/**/tests/test_*.py" if subpackages else "test_*.py"
    root = rundir / PACKAGE
    return sorted(str(p.relative_to(root)) for p in root.glob(pattern))


def record_path(out: Path, name: str) -> Path:
    """``OUT/test_worker.py.json``, ``OUT/diagnostics.tests.test_progress.py.json``."""
    return out / f"{name.replace('/', '.')}.json"


# --------------------------------------------------------------------------------------
# The receiver


def receiver_module() -> Any:
    """tests/otlp_receiver.py, the receiver the test suite and benchmarks use."""
    spec = importlib.util.spec_from_file_location(
        "otlp_receiver", REPO / "tests" / "otlp_receiver.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: What the instrumented runs export to, by ``--collector``: the receiver (``up``), or one
#: of tests/otlp_receiver.py's collectors that never answer.
COLLECTORS = {"up": None, "down": "down", "hung": "hung gRPC"}


@contextlib.contextmanager
def collector(kind: str) -> Iterator[tuple[str, Any]]:
    """The OTLP/gRPC endpoint of the collector ``kind``, and its receiver (None: it
    receives nothing)."""
    rx_module = receiver_module()
    fault = COLLECTORS[kind]
    if fault is None:
        with rx_module.OTLPReceiver() as receiver:
            yield receiver.grpc_endpoint, receiver
    else:
        with rx_module.unanswered(fault) as endpoint:
            yield endpoint, None


class Tally:
    """Counts what the receiver got, draining it every few seconds so it holds little."""

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver  #: the started OTLPReceiver, or None (nothing to count)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  #: signal -> items since the last take()
        self._processes: set[str] = set()  #: service.instance.id seen since the last take()
        self._traced: set[str] = set()  #: of those, the processes that sent dask-otel spans
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-suite-tally", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(2):
            self._drain()

    def _drain(self) -> None:
        if self._receiver is None:
            return
        spans, logs, points = self._receiver.drain()
        with self._lock:
            self._counts.update(spans=len(spans), log_records=len(logs), metric_points=len(points))
            for item in (*spans, *logs, *points):
                self._processes.add(item["resource"].get("service.instance.id", "?"))
            self._traced.update(
                s["resource"].get("service.instance.id", "?")
                for s in spans
                if s["scope"] == "dask_otel"
            )

    def take(self) -> dict[str, int]:
        """What arrived since the last call."""
        self._drain()
        with self._lock:
            counts = {
                **{k: self._counts[k] for k in ("spans", "log_records", "metric_points")},
                "processes": len(self._processes),
                "processes_with_dask_otel_spans": len(self._traced),
            }
            self._counts.clear()
            self._processes.clear()
            self._traced.clear()
        return counts

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------------------
# Running pytest


class Runner:
    """Runs pytest on distributed's tests in one mode and reads what came out."""

    def __init__(self, args: argparse.Namespace, rundir: Path, endpoint: str) -> None:
        self.args = args  #: the command line
        self.rundir = rundir  #: from run_directory()
        self.endpoint = endpoint  #: the receiver's OTLP/gRPC endpoint
        self.bindir = Path(sys.executable).parent  #: the virtualenv's bin/

    def env(self, mode: str, probe: Path) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "DASK_", "PYTEST_")) and k != "PYTHONPATH"
        }
        env.update(
            PYTHONPATH=str(self.rundir / "plugins"),
            PYTHONDONTWRITEBYTECODE="1",
            PEER_SUITE_PROBE_OUT=str(probe),
        )
        if mode == "instrumented":
            env.update(
                OTEL_TRACES_EXPORTER="otlp",
                OTEL_METRICS_EXPORTER="otlp",
                OTEL_LOGS_EXPORTER="otlp",
                OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                OTEL_EXPORTER_OTLP_ENDPOINT=self.endpoint,
                OTEL_EXPORTER_OTLP_INSECURE="true",
                OTEL_METRIC_EXPORT_INTERVAL="5000",
            )
        return env

    def command(self, mode: str, junit: Path, targets: list[str]) -> list[str]:
        cmd = [str(self.bindir / "python"), "-m", "pytest"]
        if mode == "instrumented":
            cmd.insert(0, str(self.bindir / "opentelemetry-instrument"))
        return [
            *cmd,
            *("-p", "no:cacheprovider", "-p", "peer_suite_plugin"),
            *("--timeout", str(self.args.timeout), "-o", "timeout_method=signal"),
            "--color=no",
            f"--junitxml={junit}",
            *self.args.pytest_args,
            *targets,
        ]

    def run(self, mode: str, targets: list[str], out: Path) -> dict[str, Any]:
        """Run pytest; outcomes per test id, wall time, load, exit code, leftovers, probe."""
        junit, probe = out.with_suffix(".xml"), out.with_suffix(".probe.json")
        cmd = self.command(mode, junit, targets)
        load = os.getloadavg()[0]
        start = time.monotonic()
        with open(out.with_suffix(".log"), "w") as logfile:
            process = subprocess.Popen(
                cmd,
                cwd=self.rundir,
                env=self.env(mode, probe),
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = process.wait(self.args.file_timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                wall = time.monotonic() - start
                leftovers = end_group(process.pid)
                process.wait()
        return {
            "outcomes": read_junit(junit),
            "wall": round(wall, 1),
            "load": [round(load, 2), round(os.getloadavg()[0], 2)],
            "exit": code if code is not None else f"killed after {self.args.file_timeout}s",
            "leftover_processes": leftovers,
            "probe": json.loads(probe.read_text()) if probe.exists() else None,
        }


def group_members(pgid: int) -> list[str]:
    """Command lines of the live processes of group ``pgid`` but its leader."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z" and stat.parent.name != str(pgid):
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                alive.append(cmdline.decode(errors="replace").strip()[:300])
    return alive


def end_group(pgid: int, grace: float = 5.0) -> dict[str, Any]:
    """Processes of a run that outlived pytest: what they were, how long they took to go.

    They get ``grace`` seconds, then SIGKILL.
    """
    start = time.monotonic()
    alive = group_members(pgid)
    while group_members(pgid) and time.monotonic() - start < grace:
        time.sleep(0.05)
    gone = None if group_members(pgid) else round(time.monotonic() - start, 2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return {"at_exit": alive, "gone_after_s": gone} if alive else {}


def read_junit(path: Path) -> dict[str, dict[str, str]]:
    """test id -> {"outcome", "message"}: the worst outcome of each test (setup, call, teardown)."""
    if not path.exists():
        return {}
    rank = {o: i for i, o in enumerate(("passed", "skipped", "xfailed", "failed", "error"))}
    results: dict[str, dict[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
            if child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = child.get("message") or ""
        previous = results.get(test_id)
        if previous is None or rank[outcome] > rank[previous["outcome"]]:
            results[test_id] = {"outcome": outcome, "message": message.strip()}
    return results


def node_id(test_id: str, rundir: Path) -> str:
    """``distributed_tests.test_x.TestC::test_y[p]`` -> ``distributed_tests/test_x.py::TestC::
    test_y[p]``: the module is the longest dotted prefix that is a file of ``rundir``."""
    module, name = test_id.split("::", 1)
    parts = module.split(".")
    n = next(
        i
        for i in range(len(parts), 0, -1)
        if rundir.joinpath(*parts[:i]).with_suffix(".py").exists()
    )
    return "/".join(parts[:n]) + ".py::" + "::".join([*parts[n:], name])


def counts(outcomes: dict[str, dict[str, str]]) -> dict[str, int]:
    c = Counter(r["outcome"] for r in outcomes.values())
    return {o: c.get(o, 0) for o in OUTCOMES}


# --------------------------------------------------------------------------------------
# One file


def compare_file(runner: Runner, tally: Tally, name: str, first: str, out: Path) -> dict[str, Any]:
    """Both runs of one test file, suspects re-run; the record written to OUT/<file>.json."""
    work = out / "runs" / name.removesuffix(".py")  # subpackages' files: nested directories
    work.mkdir(parents=True, exist_ok=True)
    target = [f"{PACKAGE}/{name}"]
    runs: dict[str, dict[str, Any]] = {}
    for mode in (first, *(m for m in MODES if m != first)):
        tally.take()
        runs[mode] = runner.run(mode, target, work / mode)
        runs[mode]["receiver"] = tally.take()
    plain, inst = runs["plain"]["outcomes"], runs["instrumented"]["outcomes"]
    suspects = sorted(
        t
        for t in plain
        if plain[t]["outcome"] == "passed" and inst.get(t, {}).get("outcome") in BAD
    )
    regressions = {
        t: {"message": inst[t]["message"][-3000:], **rerun(runner, t, work)} for t in suspects
    }
    record = {
        "file": name,
        "distributed": importlib.metadata.version("distributed"),
        "tests_from": f"{runner.args.tag} of {runner.args.source_git}"
        if runner.args.source_git
        else runner.args.source,
        "dask_otel": git_head(),
        "collector": runner.args.collector,
        "first": first,
        "dask_otel_active": {mode: dask_otel_active(run["probe"]) for mode, run in runs.items()},
        "runs": {
            mode: {
                **{k: v for k, v in run.items() if k != "outcomes"},
                "counts": counts(run["outcomes"]),
            }
            for mode, run in runs.items()
        },
        "outcomes": {
            t: [plain.get(t, {}).get("outcome"), inst.get(t, {}).get("outcome")]
            for t in sorted(set(plain) | set(inst))
        },
        "passed_plain_failed_instrumented": regressions,
        "failed_plain_passed_instrumented": sorted(
            t
            for t in plain
            if plain[t]["outcome"] in BAD and inst.get(t, {}).get("outcome") == "passed"
        ),
    }
    record_path(out, name).write_text(json.dumps(record, indent=1))
    return record


def dask_otel_active(probe: dict[str, Any] | None) -> bool:
    """Whether the probe saw dask-otel's instrumentor and hooks in the pytest process."""
    start = (probe or {}).get("start", {})
    hooks = start.get("hooks_installed", {})
    return bool(start.get("instrumentor_active") and hooks and all(hooks.values()))


def rerun(runner: Runner, test_id: str, work: Path) -> dict[str, Any]:
    """Run one suspect alone, ``--reruns`` times per mode, alternating; the verdict."""
    fails = dict.fromkeys(MODES, 0)
    for i in range(runner.args.reruns):
        for mode in MODES if i % 2 else MODES[::-1]:
            safe = re.sub(r"[^\w-]+", "_", test_id)[-120:]  # no dot: with_suffix()
            out = work / "reruns" / f"{safe}-{mode}-{i}"
            out.parent.mkdir(exist_ok=True)
            target = node_id(test_id, runner.rundir)
            outcome = runner.run(mode, [target], out)["outcomes"].get(test_id, {})
            fails[mode] += outcome.get("outcome") != "passed"
    if fails["plain"] == 0 and fails["instrumented"] >= 2:
        verdict = "confirmed"
    elif fails["plain"] == 0 and fails["instrumented"] == 1:
        verdict = "intermittent"
    else:
        verdict = "flaky"
    return {"verdict": verdict, "reruns": runner.args.reruns, "failed_reruns": fails}


def git_head() -> str:
    """The commit of the dask-otel under test: the checkout the virtualenv imports it from."""
    spec = importlib.util.find_spec("dask_otel")
    if spec is None or spec.origin is None:
        sys.exit("dask_otel is not installed in this Python")
    checkout = Path(spec.origin).parent.parent
    return subprocess.run(
        ["git", "-C", str(checkout), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def summary_line(record: dict[str, Any]) -> str:
    parts = []
    for mode in MODES:
        run = record["runs"][mode]
        c = run["counts"]
        parts.append(
            f"{mode} {c['passed']}p {c['failed']}f {c['error']}e {c['skipped']}s {run['wall']:.0f}s"
        )
    verdicts = Counter(r["verdict"] for r in record["passed_plain_failed_instrumented"].values())
    return f"{record['file']}: " + " | ".join(parts) + f" | suspects {dict(verdicts) or 0}"


# --------------------------------------------------------------------------------------
# The table


def report(out: Path) -> str:
    """A markdown table of every file's record in ``out``: distributed/tests' files, then
    the subpackages', with a total for each."""
    records = [json.loads(p.read_text()) for p in out.glob("*.py.json")]
    records.sort(key=lambda record: ("/" in record["file"], record["file"]))
    if not records:
        return f"no results in {out}"
    first = records[0]
    commits = Counter(record["dask_otel"] for record in records)
    collectors = Counter(record.get("collector", "up") for record in records)
    lines = [
        f"distributed {first['distributed']}, tests from {first['tests_from']}, dask-otel "
        + ", ".join(f"{commit} ({n} files)" for commit, n in commits.items())
        + ", collector "
        + ", ".join(f"{kind} ({n} files)" for kind, n in collectors.items()),
        "",
        "| file | plain p/f/e/s | s | instrumented p/f/e/s | s | ratio "
        "| passed plain, failed instrumented | spans/logs/points | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        runs = record["runs"]
        suspects = record["passed_plain_failed_instrumented"]
        named = ", ".join(f"{t.split('::', 1)[1]} ({v['verdict']})" for t, v in suspects.items())
        rx = runs["instrumented"]["receiver"]
        loads = [x for mode in MODES for x in runs[mode]["load"]]
        active = "" if record["dask_otel_active"]["instrumented"] else " (NOT ACTIVE)"
        commit = f" ({record['dask_otel']})" if len(commits) > 1 else ""
        lines.append(
            f"| {record['file']}{commit} "
            f"| {row(runs['plain'])} | {row(runs['instrumented'])} "
            f"| {runs['instrumented']['wall'] / runs['plain']['wall']:.2f} | {named or '-'} "
            f"| {rx['spans']}/{rx['log_records']}/{rx['metric_points']}{active} "
            f"| {min(loads):.1f}-{max(loads):.1f} |"
        )
    groups = {
        "of distributed/tests": [r for r in records if "/" not in r["file"]],
        "of subpackages": [r for r in records if "/" in r["file"]],
    }
    if all(groups.values()):
        lines.extend(total_row(group, label) for label, group in groups.items())
    lines.append(total_row(records))
    return "\n".join(lines)


def total_row(records: list[dict[str, Any]], label: str = "") -> str:
    total = {mode: Counter[str]() for mode in MODES}
    for record in records:
        for mode in MODES:
            run = record["runs"][mode]
            total[mode].update({**run["counts"], "wall": run["wall"]})
    ratio = total["instrumented"]["wall"] / total["plain"]["wall"]
    return (
        f"| **{len(records)} files{' ' + label if label else ''}** | {row(total['plain'])} "
        f"| {row(total['instrumented'])} | {ratio:.2f} | | | |"
    )


def row(run: dict[str, Any]) -> str:
    """``passed/failed/error/skipped | wall`` of a run or a total."""
    c = run.get("counts", run)
    return f"{c['passed']}/{c['failed']}/{c['error']}/{c['skipped']} | {run['wall']:.0f}"


# --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--source-git", metavar="DIR", help="git directory of dask/distributed")
    where.add_argument("--source", metavar="DIR", help="a source tree of dask/distributed")
    parser.add_argument("--tag", help="the release tag whose tests run (with --source-git)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--files",
        nargs="+",
        metavar="FILE",
        help="test_x.py of distributed/tests, or SUB/tests/test_x.py of a subpackage",
    )
    which.add_argument("--all", action="store_true", help="every test_*.py of distributed/tests")
    which.add_argument(
        "--subpackages",
        action="store_true",
        help="every test_*.py of distributed/*/tests (diagnostics, shuffle, comm, ...)",
    )
    parser.add_argument(
        "--skip-done", action="store_true", help="leave out files OUT has a record of"
    )
    parser.add_argument("--out", type=Path, help="results directory (kept)")
    parser.add_argument(
        "--report", type=Path, metavar="OUT", help="print the table of OUT and exit"
    )
    parser.add_argument(
        "--timeout", type=int, default=300, help="per-test timeout, s (default: 300)"
    )
    parser.add_argument(
        "--file-timeout",
        type=int,
        default=3600,
        help="per-run limit, s, then killed (default: 3600)",
    )
    parser.add_argument(
        "--reruns", type=int, default=3, help="runs per mode of each suspect (default: 3)"
    )
    parser.add_argument(
        "--collector",
        choices=COLLECTORS,
        default="up",
        help="where the instrumented runs export: the receiver (up, the default), a port "
        "where nothing listens (down), a gRPC server that never answers (hung)",
    )
    parser.add_argument(
        "--pytest-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest goes to pytest (-k, --runslow)",
    )
    args = parser.parse_args(argv)
    if args.report is None:
        if not (args.source or (args.source_git and args.tag)):
            parser.error("give --source DIR, or --source-git DIR with --tag TAG")
        if not (args.files or args.all or args.subpackages) or args.out is None:
            parser.error("give --files, --all or --subpackages, and --out")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A batch stopped with SIGTERM still ends its pytest processes and removes its tests.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.report:
        print(report(args.report))
        return 0
    args.out = args.out.resolve()  # pytest runs in the run directory
    args.out.mkdir(parents=True, exist_ok=True)
    with run_directory(args) as rundir, collector(args.collector) as (endpoint, receiver):
        every = test_files(rundir) + test_files(rundir, subpackages=True)
        if args.all or args.subpackages:
            files = test_files(rundir, subpackages=args.subpackages)
        else:
            files = args.files
        missing = sorted(set(files) - set(every))
        if missing:
            sys.exit(f"not test files of distributed: {' '.join(missing)}")
        if args.skip_done:
            files = [f for f in files if not record_path(args.out, f).exists()]
        log(
            f"distributed {importlib.metadata.version('distributed')}, dask-otel {git_head()}, "
            f"{len(files)} file(s); collector {args.collector} at {endpoint}; results in {args.out}"
        )
        runner = Runner(args, rundir, endpoint)
        tally = Tally(receiver)
        confirmed = 0
        try:
            for name in files:
                # Which mode runs first alternates over the files OUT has, across batches.
                first = MODES[len(list(args.out.glob("*.py.json"))) % 2]
                record = compare_file(runner, tally, name, first, args.out)
                log(summary_line(record))
                if record["dask_otel_active"] != {"plain": False, "instrumented": True}:
                    log(f"dask-otel active: {record['dask_otel_active']}: no record kept")
                    record_path(args.out, name).unlink()
                    return 2  # e.g. stale entry points of an editable install
                confirmed += sum(
                    r["verdict"] == "confirmed"
                    for r in record["passed_plain_failed_instrumented"].values()
                )
        finally:
            tally.stop()
    return 1 if confirmed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
