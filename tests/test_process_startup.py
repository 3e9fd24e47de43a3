"""A Python process that never uses Dask starts under ``opentelemetry-instrument`` as
plain Python would.

``opentelemetry-instrument`` puts its sitecustomize on ``PYTHONPATH``, so every Python
process a traced program starts is instrumented at startup: a multiprocessing child,
multiprocessing's resource tracker, any tool the program runs. distributed's
test_asyncprocess.py finds two differences in such a child (confirmed on 2026.8.0, the
first also on 2025.9.0):

- test_child_main_thread: the child has three more threads (the SDK's span, log record
  and metric export threads), started before anything is recorded;
- test_exit_callback: a child must start, work and exit within 5 s; starting
  ``python -c pass`` took 3.6-4.2 s instead of 0.2-0.4 s on the loaded test machine, most
  of it (1.9 of 2.6 s in sitecustomize, ``-X importtime``) importing distributed (and
  numpy through it) for dask-otel's hooks, in a process that never uses Dask.

test_config.py::test_default_logging_does_not_override_basic_config (confirmed on
2025.9.0 and 2026.8.0) shows what that early import changes: distributed sets up its own
log handler when it is imported before the program configures logging, so a program's
``logging.basicConfig()`` no longer decides how distributed's records look on stderr.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import bin_path, otel_env
from otlp_receiver import OTLPReceiver

#: Prints whether distributed was imported, and how many threads run.
CHECK = "import sys, threading; print(int('distributed' in sys.modules), threading.active_count())"
SIGNALS = {f"OTEL_{s}_EXPORTER": "otlp" for s in ("TRACES", "METRICS", "LOGS")}


def python(receiver: OTLPReceiver, code: str, *prefix: str) -> subprocess.CompletedProcess:
    """``python -c code``, started with ``prefix``, exporting to ``receiver``."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", code],
        env=otel_env(receiver, **SIGNALS),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def started(receiver: OTLPReceiver, *prefix: str) -> tuple[int, int]:
    """(distributed imported, threads) of a Python process started with ``prefix``."""
    imported, threads = python(receiver, CHECK, *prefix).stdout.split()
    return int(imported), int(threads)


@pytest.mark.xfail(
    strict=True,
    reason="issue 21: importing the instrumentor (the entry point opentelemetry-instrument "
    "loads) imports distributed; its hooks could wait for distributed's import",
)
def test_a_process_that_never_uses_dask_does_not_import_it(receiver: OTLPReceiver) -> None:
    assert started(receiver)[0] == 0  # plain
    assert started(receiver, bin_path("opentelemetry-instrument"))[0] == 0


@pytest.mark.xfail(
    strict=True,
    reason="issue 21: the configurator builds the SDK's batch span and log processors and "
    "periodic metric reader at startup, each with its thread",
)
def test_a_process_that_never_uses_dask_runs_no_more_threads(receiver: OTLPReceiver) -> None:
    plain = started(receiver)[1]
    assert started(receiver, bin_path("opentelemetry-instrument"))[1] == plain


#: distributed's test: a program that configures logging before importing distributed.
BASIC_CONFIG = """\
import logging
logging.basicConfig()
import distributed
logging.getLogger("distributed").warning("hello")
"""


@pytest.mark.xfail(
    strict=True,
    reason="issue 21: distributed, imported at startup for dask-otel's hooks, installs its "
    "own log handler before the program's logging.basicConfig()",
)
def test_a_programs_logging_config_still_formats_distributeds_records(
    receiver: OTLPReceiver,
) -> None:
    assert python(receiver, BASIC_CONFIG).stderr == "WARNING:distributed:hello\n"  # plain
    instrumented = python(receiver, BASIC_CONFIG, bin_path("opentelemetry-instrument"))
    assert instrumented.stderr == "WARNING:distributed:hello\n"
