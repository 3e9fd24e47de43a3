"""The one check every dask-otel entry point makes before it hooks into a Dask process.

One rule for ``otel.*`` settings dask-otel cannot use (a bad value, a key it does not
have), whichever way dask-otel came in: the problem is said once, on one line of stderr
(:func:`dask_otel.runtime.say_once`). A client, and a scheduler or worker that gets
dask-otel's plugin while it runs (``dask_otel.instrument(client)``), carry on untraced.
A scheduler, worker or nanny that is starting refuses to: Dask's own command (``dask
scheduler``, ``dask worker``) exits with status 1 after that one line, and any other
process (a ``LocalCluster`` in a script) gets the :class:`ConfigError` from Dask's start.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from dask_otel import runtime, strings
from dask_otel.plugins import own_runs
from dask_otel.runtime import say_once

if TYPE_CHECKING:
    from dask_otel.config import ConfigError, Settings

# dask_otel.config imports Dask's: each function imports it when it runs, so that the
# instrumentor, loaded in every process opentelemetry-instrument starts, does not.

#: Entry-point name, as listed in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``.
INSTRUMENTATION_NAME = "dask"


def disabled_by_environment() -> bool:
    """True when ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names ``dask``."""
    names = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    return INSTRUMENTATION_NAME in {name.strip() for name in names.split(",")}


def activate(role: str, server: Any = None) -> Settings | None:
    """Validated settings if dask-otel should run in this ``role``, else None.

    Two steps, both cheap once done, for a client activates on every submission: whether
    to run (the kill switches, and the settings, which follow every change of ``otel.*``),
    then :func:`_set_up`. ``server`` is the scheduler or worker dask-otel is about to
    instrument. Invalid ``otel.*`` settings: see the module's docstring.
    """
    from dask_otel.config import ConfigError, load_settings

    if disabled_by_environment():
        return None
    try:
        settings = load_settings()
    except ConfigError as e:
        return _invalid(role, server, e)
    if not settings.enabled or not _set_up(role, settings):
        return None
    return settings


def prepare_process(role: str) -> None:
    """Before a scheduler or worker is made, so that its first log lines are exported as
    ``role``: name a process dask-otel configured before its role was known (a Nanny's
    child), and set up one forked from the forkserver (where dask-otel configures
    nothing) now. Nothing where dask-otel did not configure the SDK."""
    sdk = sys.modules.get("dask_otel.distro.sdk")  # imported where it configures the SDK
    if sdk is None:
        return
    if sdk.forked_from_helper() and not runtime.is_configured():
        # Invalid settings are left to the plugin, which says so as always.
        if not disabled_by_environment() and settings_problem() is None:
            activate(role)
        return
    sdk.name_process(role)


def _set_up(role: str, settings: Settings) -> bool:
    """Make this process export as ``role``: configure the OpenTelemetry SDK from
    ``OTEL_*`` variables when nothing configured it yet (a worker reached only through a
    plugin) and name the process after ``role``, bridge Python logging, record ``rpc``
    spans. False if the SDK cannot be configured (said once): the caller runs untraced.
    Calls after the first are cheap: the SDK is configured and the log bridge
    installed once (redaction and the length cap follow the settings), and the ``rpc``
    spans take the current tracer and settings.
    """
    from dask_otel.distro import sdk
    from dask_otel.plugins import rpc

    try:
        configured = sdk.configure(role)
    except Exception as e:
        sdk.configuration_failed(e)
        configured = False
    if not configured:  # a typo in an OTEL_* variable must not stop a cluster: untraced
        return False
    bridge_logs(settings)
    if settings.rpc_spans:
        rpc.install(runtime.current().tracer(), settings)
    return True


def bridge_logs(settings: Settings) -> None:
    """Export this process's log records (``otel.logs``) from now on, redacted as set."""
    from dask_otel.signals import logs

    strings.set_redaction(settings)
    if settings.logs_enabled:
        logs.install(
            runtime.current().logger_provider,
            settings.logs_loggers,
            settings.logs_level,
            settings.max_attribute_length,
        )


@own_runs.register
def settings_problem() -> str | None:
    """What is wrong with this process's ``otel.*`` settings, if anything (``client.run``
    asks the cluster's processes before :func:`dask_otel.instrument` adds its plugins)."""
    from dask_otel.config import ConfigError, load_settings

    try:
        load_settings()
    except ConfigError as e:
        return str(e)
    return None


def check_settings(role: str, server: Any) -> None:
    """Apply the rule for invalid settings before dask-otel's plugin is added to
    ``server`` (Dask logs whatever a worker plugin's setup raises, with its traceback)."""
    from dask_otel.config import ConfigError, load_settings

    if not disabled_by_environment():
        try:
            load_settings()
        except ConfigError as e:
            _invalid(role, server, e)


def _invalid(role: str, server: Any, error: ConfigError) -> None:
    """Say what is wrong; carry on untraced, or refuse to start (see the module)."""
    if role == "client":
        say_once(f"{error}. This client runs untraced.")
        return None
    from distributed.core import Status

    if server is not None and server.status == Status.running:
        say_once(f"{error}. This {role} runs on, untraced.")
        return None
    say_once(f"{error}. This {role} does not start.")
    if _dask_command() is not None:
        raise SystemExit(1)  # past Dask's `except Exception`: no tracebacks after the line
    raise error


def _dask_command() -> str | None:
    """``scheduler``, ``worker`` or ``nanny`` in a process Dask's command line started."""
    from dask_otel.distro.sdk import infer_role  # imports the SDK: not at import time

    return infer_role(sys.argv)


def refuse_invalid_settings() -> None:
    """Stop a Dask command that starts with invalid settings, before Dask starts anything
    (a Nanny, which never activates dask-otel itself, included): one line on stderr, exit
    status 1. Called at ``opentelemetry-instrument``'s start-up, and when Dask's command
    line imports ``--preload dask_otel`` to read its options; never in the processes the
    command starts (a Nanny's worker: its command refused already, or let it start)."""
    role = _dask_command()
    if role is None or disabled_by_environment() or _servers_running():
        return
    import multiprocessing  # not at import time: this runs in every process at start-up

    if multiprocessing.parent_process() is not None:
        return
    from dask_otel.config import ConfigError, load_settings

    try:
        load_settings()
    except ConfigError as e:
        say_once(f"{e}. This {role} does not start.")
        sys.stdout.flush()
        os._exit(1)  # at interpreter start-up (sitecustomize): SystemExit would be fatal


def _servers_running() -> bool:
    """Whether Dask already runs here (instrumenting from inside a task, say)."""
    from distributed import Nanny, Scheduler, Worker

    return any(server_type._instances for server_type in (Scheduler, Worker, Nanny))
