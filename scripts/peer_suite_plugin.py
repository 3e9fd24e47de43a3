"""pytest plugin that scripts/peer_suite.py loads in both runs of distributed's tests.

It writes to ``PEER_SUITE_PROBE_OUT`` whether dask-otel was active in the pytest
process: the evidence that the instrumented run was instrumented and the plain run was
not.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

#: the probe's state at the start of the session, kept for the report at its end
_START = pytest.StashKey[dict[str, Any]]()


def _state() -> dict[str, Any]:
    state: dict[str, Any] = {"dask_otel_imported": "dask_otel" in sys.modules}
    if state["dask_otel_imported"]:
        import distributed

        from dask_otel import DaskInstrumentor

        state["instrumentor_active"] = bool(DaskInstrumentor().is_instrumented_by_opentelemetry)
        state["hooks_installed"] = {
            name: hasattr(getattr(distributed, name).__init__, "__wrapped__")
            for name in ("Scheduler", "Worker", "Nanny")
        }
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        state["tracer_provider"] = type(trace.get_tracer_provider()).__name__
    state["otel_env"] = sorted(k for k in os.environ if k.startswith("OTEL_"))
    return state


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_START] = _state()


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("PEER_SUITE_PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump({"start": session.config.stash[_START], "end": _state()}, f)
