"""scripts/peer_suite.py, the referee of "instrumentation changes nothing", can call a foul.

A source tree with one test that passes whatever happens and one that fails only when
dask-otel is active: the script must run both modes for real (the instrumented run under
``opentelemetry-instrument``, the probe seeing dask-otel's hooks), confirm the second test
as a regression on re-runs, exit 1, and put it in the table. The same for a test of a
subpackage's ``tests`` directory (in a class, importing a helper of its directory by
distributed's module path).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "peer_suite.py"

TESTS = """
import sys


def test_same():
    assert 1 + 1 == 2


def test_broken_by_dask_otel():
    assert "dask_otel" not in sys.modules
"""


SUBPACKAGE_TESTS = """
import sys

from distributed.diagnostics.tests.helpers import MODULE


class TestProbe:
    def test_broken_by_dask_otel(self):
        assert MODULE not in sys.modules
"""


def source_tree(tmp_path: Path) -> Path:
    """A distributed source tree with the probe tests (no ``__init__.py`` in the
    subpackage's tests directory, as in distributed's ``diagnostics/tests``)."""
    source = tmp_path / "distributed-source"
    (source / "distributed" / "tests").mkdir(parents=True)
    (source / "distributed" / "tests" / "__init__.py").write_text("")
    (source / "distributed" / "tests" / "test_probe.py").write_text(TESTS)
    sub = source / "distributed" / "diagnostics" / "tests"
    sub.mkdir(parents=True)
    (sub / "helpers.py").write_text('MODULE = "dask_otel"\n')
    (sub / "test_sub.py").write_text(SUBPACKAGE_TESTS)
    (source / "conftest.py").write_text("")
    (source / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-rf"\n')
    return source


def peer_suite(source: Path, out: Path, files: str) -> subprocess.CompletedProcess:
    args = ["--source", source, "--files", files, "--out", out, "--reruns", "2"]
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240
    )


def report(out: Path) -> str:
    return subprocess.run(
        [sys.executable, SCRIPT, "--report", out], capture_output=True, text=True, check=True
    ).stdout


def test_peer_suite_confirms_a_regression(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run = peer_suite(source_tree(tmp_path), out, "test_probe.py")
    assert run.returncode == 1, run.stdout + run.stderr

    record = json.loads((out / "test_probe.py.json").read_text())
    assert record["dask_otel_active"] == {"plain": False, "instrumented": True}
    assert record["outcomes"] == {
        "distributed_tests.test_probe::test_broken_by_dask_otel": ["passed", "failed"],
        "distributed_tests.test_probe::test_same": ["passed", "passed"],
    }
    (suspect,) = record["passed_plain_failed_instrumented"].values()
    assert suspect["verdict"] == "confirmed"
    assert suspect["failed_reruns"] == {"plain": 0, "instrumented": 2}

    table = report(out)
    assert "| test_probe.py | 2/0/0/0 |" in table
    assert "test_broken_by_dask_otel (confirmed)" in table


def test_peer_suite_confirms_a_regression_in_a_subpackage(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run = peer_suite(source_tree(tmp_path), out, "diagnostics/tests/test_sub.py")
    assert run.returncode == 1, run.stdout + run.stderr

    record = json.loads((out / "diagnostics.tests.test_sub.py.json").read_text())
    test_id = "distributed_tests.diagnostics.tests.test_sub.TestProbe::test_broken_by_dask_otel"
    assert record["outcomes"] == {test_id: ["passed", "failed"]}
    # Re-run alone by its node id (file, class, test): a wrong one fails in both modes.
    suspect = record["passed_plain_failed_instrumented"][test_id]
    assert suspect["failed_reruns"] == {"plain": 0, "instrumented": 2}
    assert suspect["verdict"] == "confirmed"

    table = report(out)
    assert "| diagnostics/tests/test_sub.py | 1/0/0/0 |" in table
