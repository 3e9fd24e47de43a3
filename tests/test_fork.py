"""A process that forks while its exports run: each child exports, and exits.

A Nanny started with the ``fork`` method forks its worker from a process whose export
threads may be exporting at that instant. A thread inside gRPC at a fork leaves the child
that call's locks held (its exports on the channel, and its exit, which closes the
channel, wait forever) and makes gRPC skip its own fork handlers (the child may abort):
``runtime.fork_gate`` makes a fork wait for the exports under way.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import bin_path, otel_env

#: Forks ``argv[1]`` children while two threads keep the export threads busy (spans, log
#: records, metrics every 20 ms); each child records, flushes, and exits as a process does
#: (its exit shuts the exporters down). Prints each child that did not exit 0.
FORKS = """
import faulthandler, logging, os, signal, sys, threading, time
from opentelemetry import _logs, metrics, trace
from opentelemetry.instrumentation.logging.handler import LoggingHandler
from dask_otel import runtime

log = logging.getLogger("forks")
log.addHandler(LoggingHandler(logger_provider=_logs.get_logger_provider()))
log.propagate = False
tracer = trace.get_tracer("forks")
metrics.get_meter("forks").create_observable_gauge("forks.gauge", callbacks=[lambda _: []])
stop = threading.Event()

def record(name):
    with tracer.start_as_current_span(name):
        pass
    log.warning(name)

def keep_exporting(thread):
    n = 0
    while not stop.is_set():
        record(f"parent {thread} {n}")
        n += 1
        time.sleep(0.003 * (thread + 1))

def child(i):
    faulthandler.dump_traceback_later(60, exit=True)  # stuck: say where, and exit 1
    record(f"child {i}")
    for _ in range(20):  # a loaded machine is slow, not stuck
        if runtime.flush(runtime.current(), 5):
            sys.exit(0)  # the exit shuts the exporters down
        time.sleep(1)
    faulthandler.dump_traceback()  # where its exports stand
    sys.exit(3)

def exit_code(pid):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"

threads = [threading.Thread(target=keep_exporting, args=(k,), daemon=True) for k in (0, 1)]
for thread in threads:
    thread.start()
for i in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        child(i)
    code = exit_code(pid)
    if code != 0:
        print(f"child {i}: {code}", flush=True)
        break
stop.set()
for thread in threads:  # a record of theirs made during the exit's drain would be lost
    thread.join()
"""


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_child_forked_while_exports_run_exports_and_exits(receiver, protocol):
    """Before the fork gate, a child soon failed: on ef81200 the 3rd (its metric flush
    waited forever for the reader's export lock), with 7780859's threads on demand the
    2nd, 2nd and 18th of three runs (its log record never exported). Over OTLP/HTTP,
    before children closed the connections they inherited, parent and children wrote
    into the same ones: batches rejected (400 Bad Request), children's spans lost."""
    forks = 60
    env = otel_env(
        receiver,
        protocol,
        OTEL_BSP_SCHEDULE_DELAY="5",
        OTEL_BLRP_SCHEDULE_DELAY="5",
        OTEL_METRIC_EXPORT_INTERVAL="20",
    )
    out = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, "-c", FORKS, str(forks)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0 and not out.stdout, out.stdout + out.stderr[-5000:]
    assert "not exported" not in out.stderr, out.stderr[-5000:]
    children = {f"child {i}" for i in range(forks)}
    spans = {span["name"] for span in receiver.spans()}
    records = {record["body"] for record in receiver.log_records()}
    assert children <= spans and children <= records


#: Counts the fork handlers dask-otel's modules register (all that register one imported).
HANDLERS = """
import os
registered = []
register = os.register_at_fork
os.register_at_fork = lambda **handlers: registered.append(handlers) or register(**handlers)
import dask_otel.distro.sdk, dask_otel.export.metric_readers, dask_otel.spans.emitter
import dask_otel.signals.metrics, dask_otel.identity
print(sum(
    any(str(handler.__module__).startswith("dask_otel") for handler in handlers.values())
    for handlers in registered
))
"""


def test_dask_otel_has_one_fork_handler():
    """runtime's, which forgets each module's state of the parent in one known order
    (seven handlers before, one per module, in import order)."""
    out = subprocess.run(
        [sys.executable, "-c", HANDLERS], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["1"]


#: A fork while dask-otel's work never ends, in another thread or in the forking one.
FORK_DURING_WORK = """
import os, sys, threading
from dask_otel import runtime
entered, never = threading.Event(), threading.Event()

def work_forever():
    with runtime.fork_gate.work():
        entered.set()
        never.wait()

def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

if sys.argv[1] == "another thread":
    threading.Thread(target=work_forever, daemon=True).start()
    entered.wait()
    fork()
else:
    with runtime.fork_gate.work():  # a metric callback that forks, say
        fork()
print("forked")
"""


@pytest.mark.parametrize("whose", ["another thread", "its own"])
def test_a_fork_waits_for_work_under_way_boundedly(whose):
    """Work that never ends (an export or a collection stuck, with no queue telling the
    collector's health) holds a fork up for ``runtime.FORK_WAIT`` at most, and a thread's
    own work not at all: the forking thread may be an event loop."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_DURING_WORK, whose],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["forked"], out.stderr


#: Forks ``argv[1]`` children while a thread keeps reading the counts of lost spans under
#: their lock (in many steps: a thread switch may come meanwhile); each child counts one.
FORK_DURING_COUNT_READ = """
import logging, os, signal, sys, threading
from dask_otel.export import drops

logging.disable()  # what is said of the losses
for reason in range(1000):
    drops.count_dropped("traces", str(reason), 1)

def read_forever():
    while True:
        drops.losses.said.clear()  # read the counts each time
        drops.warn_dropped("traces")

threading.Thread(target=read_forever, daemon=True).start()
for i in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # stuck on a lock the parent's thread held at the fork: killed
        drops.count_dropped("traces", "queue_full", 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        print(f"child {i}: {os.waitstatus_to_exitcode(status)}", flush=True)
        break
print("forked")
"""


def test_a_forked_child_counts_its_losses():
    """Whatever a thread of its parent held at the fork: drops' lock is the child's own
    (before, one of the first children, forked mid-read, never counted and was killed)."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_DURING_COUNT_READ, "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split() == ["forked"], out.stdout + out.stderr


#: A process that lost spans forks: what does its child count as lost?
DROPS_IN_CHILD = """
import os
from dask_otel.export import drops
drops.count_dropped("traces", "queue_full", 5)
pid = os.fork()
if pid == 0:
    os._exit(len(drops.dropped()))
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), sum(drops.dropped().values()))
"""


def test_a_forked_child_counts_only_its_own_losses():
    """The parent's losses are the parent's: a child that counted them too would report
    them again at its exit (and in its ``dask_otel.exporter.dropped``)."""
    out = subprocess.run(
        [sys.executable, "-c", DROPS_IN_CHILD], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["0", "5"], out.stdout + out.stderr
