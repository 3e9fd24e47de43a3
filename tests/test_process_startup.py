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

So dask-otel's hooks wait for distributed's import, and its log bridge for dask's
(:mod:`dask_otel.hooks`): the tests below also check that they still reach every server
however a program imports distributed, and records made before the first Dask object.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from conftest import bin_path, otel_env
from otlp_receiver import OTLPReceiver

from dask_otel import hooks

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


def test_a_process_that_never_uses_dask_does_not_import_it(receiver: OTLPReceiver) -> None:
    assert started(receiver)[0] == 0  # plain
    assert started(receiver, bin_path("opentelemetry-instrument"))[0] == 0


def test_a_process_that_never_uses_dask_runs_no_more_threads(receiver: OTLPReceiver) -> None:
    plain = started(receiver)[1]
    assert started(receiver, bin_path("opentelemetry-instrument"))[1] == plain


#: Prints whether dask is imported when the program runs, then ``dask imported`` if it is
#: imported later, the interpreter's exit included.
WATCH_DASK = (
    "import os, sys; print(int('dask' in sys.modules), end='', flush=True);"
    " sys.addaudithook(lambda event, args: event == 'import'"
    " and args[0] == 'dask' and os.write(1, b' dask imported'))"
)


def test_a_process_that_never_uses_dask_never_imports_dask(receiver: OTLPReceiver) -> None:
    assert python(receiver, WATCH_DASK).stdout == "0"  # plain
    assert python(receiver, WATCH_DASK, bin_path("opentelemetry-instrument")).stdout == "0"


#: distributed's test: a program that configures logging before importing distributed.
BASIC_CONFIG = """\
import logging
logging.basicConfig()
import distributed
logging.getLogger("distributed").warning("hello")
"""


def test_a_programs_logging_config_still_formats_distributeds_records(
    receiver: OTLPReceiver,
) -> None:
    assert python(receiver, BASIC_CONFIG).stderr == "WARNING:distributed:hello\n"  # plain
    instrumented = python(receiver, BASIC_CONFIG, bin_path("opentelemetry-instrument"))
    assert instrumented.stderr == "WARNING:distributed:hello\n"


#: A program's Dask servers, distributed imported as the first line says: prints whether
#: a scheduler, a worker and a Nanny's worker get dask-otel's plugin, and the Nanny's
#: preloads.
SERVERS = """\
{import_line}
import asyncio
from distributed import Nanny, Scheduler, Worker

async def main():
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        async with Worker(s.address, host="127.0.0.1") as w:
            nanny = Nanny(s.address, host="127.0.0.1")
            worker_plugins = [p.name for p in nanny.worker_kwargs["plugins"]]
            print(*("dask-otel" in p for p in (s.plugins, w.plugins, worker_plugins)))
            print([p.name for p in nanny.preloads])

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "import_line",
    [
        "import distributed",
        "from distributed import Client",
        "from dask.distributed import Client",
        "import distributed.nanny",
        "import dask",
    ],
)
def test_dask_otel_hooks_into_distributed_however_it_is_imported(
    receiver: OTLPReceiver, import_line: str
) -> None:
    code = SERVERS.format(import_line=import_line)
    out = python(receiver, code, bin_path("opentelemetry-instrument")).stdout.splitlines()
    assert out == ["True True True", "['dask_otel']"]


#: Instruments, uninstruments and instruments again before distributed is imported, then
#: uninstruments: whether a scheduler started after each step gets dask-otel's plugin.
ON_AND_OFF = """\
import asyncio
from dask_otel import DaskInstrumentor

async def plugins():
    from distributed import Scheduler

    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        return "dask-otel" in s.plugins

instrumentor = DaskInstrumentor()
instrumentor.instrument()
instrumentor.uninstrument()
instrumentor.instrument()
print(asyncio.run(plugins()))
instrumentor.uninstrument()
print(asyncio.run(plugins()))
"""


def test_the_hooks_follow_the_instrumentor_until_distributed_is_imported(
    receiver: OTLPReceiver,
) -> None:
    assert python(receiver, ON_AND_OFF).stdout.splitlines() == ["True", "False"]


#: A program's record made once Dask is imported (as the first line says), before any
#: Dask object.
EARLY_RECORD = """\
{import_line}
import logging
logging.getLogger("probe").warning("before any Dask object")
"""


@pytest.mark.parametrize("import_line", ["import dask", "from dask.distributed import Client"])
def test_records_made_before_the_first_dask_object_are_exported(
    receiver: OTLPReceiver, import_line: str
) -> None:
    code = EARLY_RECORD.format(import_line=import_line)
    assert python(receiver, code).stderr == "before any Dask object\n"  # plain
    instrumented = python(receiver, code, bin_path("opentelemetry-instrument"))
    assert instrumented.stderr == "before any Dask object\n"
    receiver.wait_for(
        lambda rx: any(r["body"] == "before any Dask object" for r in rx.log_records())
    )


def test_a_hook_that_fails_never_fails_the_import(tmp_path, monkeypatch, caplog) -> None:
    (tmp_path / "startup_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken() -> None:
        raise RuntimeError("probe: broken hook")

    hooks.when_imported("startup_probe_module", broken)
    with caplog.at_level(logging.ERROR, logger="dask_otel.hooks"):
        import startup_probe_module  # type: ignore[import-not-found]

    assert startup_probe_module.VALUE == 1
    [record] = caplog.records
    assert record.getMessage() == "dask-otel could not hook into startup_probe_module"
    assert "probe: broken hook" in str(record.exc_info[1])


#: What opentelemetry-instrument does, once dask is imported: as in ``dask scheduler``,
#: whose instrumentor imports distributed to check the Dask command's settings.
DASK_FIRST = """\
import logging
import dask
from dask_otel import DaskInstrumentor
from dask_otel.distro.sdk import DaskOtelConfigurator

DaskOtelConfigurator().configure()
DaskInstrumentor().instrument()
logging.getLogger("probe").warning("before any Dask object")
"""


def test_records_are_exported_from_the_start_when_dask_came_first(
    receiver: OTLPReceiver,
) -> None:
    python(receiver, DASK_FIRST)
    receiver.wait_for(
        lambda rx: any(r["body"] == "before any Dask object" for r in rx.log_records())
    )
