"""scripts/peer_suite.py, the referee of "instrumentation changes nothing", can call a foul.

A source tree with one test that passes whatever happens and one that fails only when
dask-otel is active: the script must run both modes for real (the instrumented run under
``opentelemetry-instrument``, the probe seeing dask-otel's hooks), confirm the second test
as a regression on re-runs, exit 1, and put it in the table.
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


def test_peer_suite_confirms_a_regression(tmp_path: Path) -> None:
    source = tmp_path / "distributed-source"
    (source / "distributed" / "tests").mkdir(parents=True)
    (source / "distributed" / "tests" / "__init__.py").write_text("")
    (source / "distributed" / "tests" / "test_probe.py").write_text(TESTS)
    (source / "conftest.py").write_text("")
    (source / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-rf"\n')
    out = tmp_path / "results"

    args = ["--source", source, "--files", "test_probe.py", "--out", out, "--reruns", "2"]
    run = subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
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

    table = subprocess.run(
        [sys.executable, SCRIPT, "--report", out], capture_output=True, text=True, check=True
    ).stdout
    assert "| test_probe.py | 2/0/0/0 |" in table
    assert "test_broken_by_dask_otel (confirmed)" in table
