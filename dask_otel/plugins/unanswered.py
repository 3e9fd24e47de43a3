"""Whether a traced client's submissions get ``graph`` spans back from the scheduler.

A client exporting to one collector and a cluster exporting nowhere (another endpoint
where nothing listens, or no dask-otel at all) leave ``compute`` spans with nothing under
them, and a task that failed leaves no span: the recording looks complete, and is not.
After its first traced submission the client asks the scheduler, once, whether it can
answer; the scheduler tells from its own exports, as soon as one has ended, and the
client says what is wrong on one line of stderr. One call, off the submitting thread; no
answer (an old scheduler, a client that closed first) says nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from dask_otel import runtime
from dask_otel.plugins import own_runs
from dask_otel.plugins.activation import settings_problem
from dask_otel.runtime import PLUGIN_NAME, say_once
from dask_otel.runtime_state import Once

logger = logging.getLogger(__name__)

#: Longest the scheduler waits for its first export to end (an exporter gives up on an
#: unreachable collector after its 10 s timeout), and how often it looks.
WAIT = 30.0
POLL = 0.2
#: The scheduler is asked once per process.
_ask_once = runtime.own(Once())


def watch(client: Any) -> None:
    """After a traced submission of ``client``: ask the scheduler once per process."""
    if not _ask_once.now():
        return
    try:
        client.loop.add_callback(_ask, client)
    except Exception:  # a closing client: nothing to ask
        logger.debug("dask-otel: cannot ask the scheduler about graph spans", exc_info=True)


async def _ask(client: Any) -> None:
    try:
        problem = await client._run_on_scheduler(graph_spans_problem)
    except Exception:  # no dask-otel there, a closed client: nothing to say
        logger.debug("dask-otel: the scheduler did not say about graph spans", exc_info=True)
        return
    if problem:
        say_once(f"{problem}. This client's submissions get no graph span back.")


@own_runs.register
async def graph_spans_problem(dask_scheduler: Any) -> str | None:
    """Runs on the scheduler: why its ``graph`` spans do not leave, or None when they do
    (or when it cannot tell: dask-otel does not export here itself)."""
    scheduler = f"the scheduler at {dask_scheduler.address}"
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return (
            f"{scheduler} runs no dask-otel (start it under opentelemetry-instrument or "
            "with --preload dask_otel, or call dask_otel.instrument(client))"
        )
    if plugin.settings is None:  # off; settings it cannot use were said where it started
        return None if settings_problem() else f"dask-otel is off in {scheduler}"
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip() == "none":
        return f"{scheduler} exports no spans (OTEL_TRACES_EXPORTER=none)"
    health = runtime.health
    deadline = time.monotonic() + WAIT
    while health.watched and not (health.last_success or health.last_failure):
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(POLL)
    if not health.watched or health.last_success >= health.last_failure:
        return None
    return (
        f"{scheduler} cannot export to {_destination()} "
        "(is the cluster's OTEL_EXPORTER_OTLP_ENDPOINT where this client's is?)"
    )


def _destination() -> str:
    """Where this process exports its spans, as its exporter names it."""
    from dask_otel.export.queues import export_queues

    for queue in export_queues:
        endpoint = getattr(queue.exporter.exporter, "_endpoint", None)
        if queue.signal == "traces" and endpoint:
            return str(endpoint)
    return "its collector"
